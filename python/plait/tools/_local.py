"""Helpers for commands that start local ranks on this machine (demo, bench, doctor --local,
demo_ddp, the testbed), portable to Linux, macOS and Windows.

Process groups: a local rank is started in its own session on POSIX (`popen_kwargs()`), so that it
and everything it started can be killed together (`kill_group`, `stop_all`) and a Ctrl-C at the
terminal reaches only the parent, which then tears the ranks down. Windows has no process groups
to signal (and no `os.killpg`, SIGKILL or `start_new_session`): there the rank itself is
terminated (`Popen.kill()`, TerminateProcess).

The ranks' store comes from plait._store (`tcp_store`), shared with the library's init_from_env.
"""

import json
import os
import signal
import socket
import subprocess
import time

POSIX_GROUPS = hasattr(os, "killpg")  # False on Windows


def free_port() -> int:
    """A free TCP port on loopback, for MASTER_PORT of local ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json_lines(rank, stream, events):
    """Forwards every JSON line a rank prints as (rank, object); (rank, None) at end of stream.
    Other lines (warnings, tracebacks) are skipped: the rank's exit status reports failure."""
    for line in stream:
        try:
            events.put((rank, json.loads(line)))
        except ValueError:
            pass
    events.put((rank, None))


# -- processes ----------------------------------------------------------------------------------------
def popen_kwargs():
    """subprocess.Popen keyword arguments for a local rank: its own session (process group) on
    POSIX; nothing on Windows, where `start_new_session` does not exist."""
    return {"start_new_session": True} if POSIX_GROUPS else {}


def kill_group(proc, sig=None):
    """Sends `sig` (default: SIGKILL) to the process group of `proc` (started with
    `popen_kwargs()`) if `proc` is still running. Without process groups (Windows): SIGTERM
    becomes `proc.terminate()`, SIGKILL `proc.kill()` (both TerminateProcess), and signals that
    do not exist there (SIGCONT, SIGSTOP) do nothing. Never raises for a process that is gone."""
    if proc.poll() is not None:
        return
    if POSIX_GROUPS:
        try:
            os.killpg(proc.pid, signal.SIGKILL if sig is None else sig)
        except (ProcessLookupError, PermissionError):  # gone; macOS says EPERM for a zombie group
            pass
        return
    term = getattr(signal, "SIGTERM", None)
    if sig is not None and sig not in (term, getattr(signal, "SIGKILL", None)):
        return
    try:
        if sig is not None and sig == term:
            proc.terminate()
        else:
            proc.kill()
    except OSError:
        pass


def stop_all(procs, term_wait=2.0):
    """Ends every process (group): SIGCONT (a stopped rank could not act on SIGTERM) and SIGTERM,
    SIGKILL to what is left after `term_wait` seconds, then reaps all."""
    cont = getattr(signal, "SIGCONT", None)
    if cont is not None:
        for p in procs:
            kill_group(p, cont)
    for p in procs:
        kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + term_wait
    for p in procs:
        try:
            p.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        kill_group(p)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
