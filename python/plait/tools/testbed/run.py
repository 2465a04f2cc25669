"""Running one process (or a few) per testbed node, torchrun style: environment per rank, output
prefixed by rank, bounded in time, and every process dead afterwards whatever happens."""

import subprocess
import sys
import threading
import time

# stop_all: SIGTERM every process group, SIGKILL what is left after a grace period, reap all; shared
# with the commands that start local ranks (plait.tools._local), and imported from here by older callers.
from .._local import stop_all


class RunResult:
    def __init__(self, returncodes, lines, timed_out, elapsed, first_failure):
        self.returncodes = returncodes
        self.lines = lines  # per rank: every output line (stdout and stderr merged)
        self.timed_out = timed_out
        self.elapsed = elapsed
        self.first_failure = first_failure  # rank that failed first, or None

    @property
    def ok(self):
        return not self.timed_out and all(c == 0 for c in self.returncodes if c is not None)

    @property
    def exit_code(self):
        if self.timed_out:
            return 124
        if self.first_failure is not None:
            code = self.returncodes[self.first_failure]
            return code if 0 < code < 256 else 1
        return next((c if 0 < c < 256 else 1 for c in self.returncodes if c not in (None, 0)), 0)

    def output(self, rank):
        return "\n".join(self.lines[rank])

    def __repr__(self):
        return f"<RunResult codes={self.returncodes} timed_out={self.timed_out} {self.elapsed:.1f}s>"


def run_ranks(tb, cmd, *, timeout=600.0, env=None, rank_env=None, master_port=None, stream=True, out=None,
              grace=10.0, ranks=None, per_node=1):
    from . import free_port

    if per_node < 1:
        raise ValueError(f"per_node must be at least 1, not {per_node}")
    world = tb.n * per_node

    out = out or sys.stdout
    ranks = list(range(world)) if ranks is None else list(ranks)
    port = master_port or free_port()
    width = len(str(world - 1))
    lines = {r: [] for r in ranks}
    lock = threading.Lock()
    procs = []

    def reader(r, stream_):
        for raw in iter(stream_.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with lock:
                lines[r].append(line)
                if stream:
                    out.write(f"[{r:>{width}}] {line}\n")
                    out.flush()
        stream_.close()

    t0 = time.monotonic()
    timed_out = False
    first_failure = None
    threads = []
    try:
        for r in ranks:
            argv = cmd(r) if callable(cmd) else cmd
            e = tb.env(r, port, dict(env or {}, **((rank_env or {}).get(r, {}))), per_node=per_node)
            p = tb.popen(r // per_node, argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL)
            procs.append(p)
            t = threading.Thread(target=reader, args=(r, p.stdout), daemon=True)
            t.start()
            threads.append(t)
        deadline = t0 + timeout
        kill_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if first_failure is None:
                for r, c in zip(ranks, codes):
                    if c not in (None, 0):
                        first_failure = r
                        kill_at = time.monotonic() + grace
                        break
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                with lock:
                    out.write(f"plait testbed: timeout after {timeout:g} s; killing every rank\n")
                break
            if kill_at is not None and now > kill_at:
                with lock:
                    still = [r for r, p in zip(ranks, procs) if p.poll() is None]
                    out.write(f"plait testbed: rank {first_failure} failed; killing ranks {still} "
                              f"after {grace:g} s\n")
                break
            time.sleep(0.05)
    finally:
        stop_all(procs)
        for t in threads:
            t.join(5)
    codes = [p.returncode if p.returncode is not None else -9 for p in procs]
    if first_failure is None:
        first_failure = next((r for r, c in zip(ranks, codes) if c != 0), None)
    full = [lines.get(r, []) for r in range(world)]
    full_codes = [None] * world
    for r, c in zip(ranks, codes):
        full_codes[r] = c
    return RunResult(full_codes, full, timed_out, time.monotonic() - t0,
                     first_failure)
