"""Failures: a killed rank, a stopped rank, abort() from another thread, ranks that disagree, junk on a
listening port. Each scenario is its own world (cases_faults.py); the parent steers and judges."""

import json
import os
import re
import signal
import socket
import struct
import time

import pytest

import harness


def _errors(res, rank, what=None):
    return [e for e in res.of(rank, "error") if what is None or e["what"].startswith(what)]


def _kill_or_stop(sig, victim, marks):
    def control(world):
        world.wait_keys([f"ready/{r}" for r in range(world.n)], 90)
        time.sleep(0.5)  # well inside the loop of allreduces
        marks["t"] = time.time()
        world.send_signal(victim, sig)
        if sig == signal.SIGSTOP:  # leave it stopped until the others are done, then kill it
            world.wait_ranks([r for r in range(world.n) if r != victim], 120)
            world.send_signal(victim, signal.SIGKILL)

    return control


# 2**24 floats: 64 MiB, read by the links' receiver threads; 256 floats: 1 KiB, read by the
# calling thread (caller progress), whose parked receiver threads must not hide the death.
# PLAIT_STREAMS=3: a death seen on three connections per peer is still one error naming it.
@pytest.mark.parametrize("n,victim,count,streams,subgroup", [(3, 1, 2**24, 1, False), (4, 0, 2**24, 1, False),
                                                             (3, 2, 256, 1, False), (3, 0, 2**24, 3, False),
                                                             (3, 0, 2**24, 1, True), (3, 2, 256, 1, True)])
def test_sigkill_during_allreduce(n, victim, count, streams, subgroup):
    deadline = 10.0
    marks = {}
    res = harness.run_world("cases_faults", n,
                            args={"scenario": "kill", "victim": victim, "timeout": deadline, "count": count,
                                  "subgroup": subgroup},
                            env={"PLAIT_STREAMS": str(streams)},
                            control=_kill_or_stop(signal.SIGKILL, victim, marks), timeout=180)
    survivors = [r for r in range(n) if r != victim]
    res.assert_ok(survivors)
    problems = []
    for r in survivors:
        errs = _errors(res, r)
        if len(errs) != 1:
            problems.append(f"rank {r}: {len(errs)} errors reported")
            continue
        e = errs[0]
        tte = e["t_err"] - marks["t"]
        harness.note(f"SIGKILL of rank {victim} during {count * 4} B allreduces ({streams} stream(s) per peer): "
                     f"rank {r} raised {e['type']} "
                     f"{tte * 1000:.0f} ms after the kill: {e['msg']}")
        # BrokenError: the failure arrived between two allreduces, so the next call found the
        # communicator already broken (its message carries the cause).
        if e["type"] not in ("PeerError", "BrokenError"):
            problems.append(f"rank {r}: {e['type']} (expected PeerError): {e['msg']}")
        if not re.search(rf"\brank {victim}\b", e["msg"]):
            problems.append(f"rank {r}: error does not name rank {victim}: {e['msg']}")
        if not 0 <= tte <= deadline:
            problems.append(f"rank {r}: error {tte:.2f} s after the kill (deadline {deadline} s)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("count,streams", [(2**20, 1), (256, 1), (2**20, 2)])
def test_sigstop_hits_deadline(count, streams):
    n, victim, deadline = 3, 2, 3.0
    marks = {}
    res = harness.run_world("cases_faults", n,
                            args={"scenario": "stop", "victim": victim, "timeout": deadline, "count": count},
                            env={"PLAIT_STREAMS": str(streams)},
                            control=_kill_or_stop(signal.SIGSTOP, victim, marks), timeout=180)
    survivors = [r for r in range(n) if r != victim]
    res.assert_ok(survivors)
    problems, types = [], []
    for r in survivors:
        errs = _errors(res, r)
        if len(errs) != 1:
            problems.append(f"rank {r}: {len(errs)} errors reported")
            continue
        e = errs[0]
        types.append(e["type"])
        tte = e["t_err"] - marks["t"]
        harness.note(f"SIGSTOP of rank {victim} during {count * 4} B allreduces (deadline {deadline} s): rank {r} raised {e['type']} "
                     f"after {tte:.2f} s: {e['msg']}")
        if e["type"] not in ("PlaitTimeoutError", "PeerError", "BrokenError"):
            problems.append(f"rank {r}: {e['type']}: {e['msg']}")
        if not re.search(r"\brank \d+\b", e["msg"]):
            problems.append(f"rank {r}: error names no rank: {e['msg']}")
        if tte > 2 * deadline + 2:
            problems.append(f"rank {r}: raised {tte:.2f} s after the stop (deadline {deadline} s)")
    timeouts = [e for r in survivors for e in _errors(res, r) if e["type"] == "PlaitTimeoutError"]
    if not any(re.search(rf"\brank {victim}\b", e["msg"]) for e in timeouts):
        problems.append(f"no PlaitTimeoutError names the stopped rank {victim}: {types}")
    assert not problems, "\n".join(problems)


def test_abort_from_another_thread():
    n = 3
    res = harness.run_world("cases_faults", n, args={"scenario": "abort"}, timeout=240)
    res.assert_ok()
    problems = []
    for phase in ("abort A", "abort B"):
        fired = [e for e in res.of(0, "aborted") if e["what"] == phase]
        if not fired:
            problems.append(f"{phase}: the abort thread did not fire")
            continue
        t_abort = fired[0]["t_abort"]
        for e in _errors(res, 0, phase):
            dt = e["t_err"] - t_abort
            harness.note(f"{phase}: rank 0 {e['what']} raised {e['type']} {dt * 1000:.0f} ms after abort()")
            if e["type"] not in ("AbortedError", "BrokenError") or (phase == "abort A" and e["type"] != "AbortedError"):
                problems.append(f"{phase}: rank 0 {e['what']}: {e['type']}: {e['msg']}")
            if dt > 1.0:
                problems.append(f"{phase}: rank 0 {e['what']} ended {dt:.2f} s after abort() (limit 1 s)")
        for r in range(1, n):
            for e in _errors(res, r, phase):
                harness.note(f"{phase}: rank {r} {e['what']} raised {e['type']} after {e['elapsed']:.2f} s: {e['msg']}")
    assert not problems, "\n".join(problems)


def test_mismatched_collectives():
    n, deadline = 3, 10.0
    res = harness.run_world("cases_faults", n, args={"scenario": "mismatch", "timeout": deadline}, timeout=240)
    res.assert_ok()
    from cases_faults import _mismatch_cases

    problems = []
    for name, (_, must_fail, must_detect) in _mismatch_cases(n).items():
        events = {r: [e for e in res.of(r, "mismatch") if e["case"] == name] for r in range(n)}
        kinds = {r: [(e["stage"], e["type"]) for e in evs] for r, evs in events.items()}
        harness.note(f"mismatch '{name}': " + "; ".join(
            f"rank {r}: " + ", ".join(f"{s} {t or 'ok'}" for s, t in k) for r, k in kinds.items()))
        if must_detect and not any(t == "MismatchError" for k in kinds.values() for _, t in k):
            problems.append(f"{name}: no rank raised MismatchError: {kinds}")
        for r in must_fail:
            if ("call", None) in kinds[r]:
                problems.append(f"{name}: rank {r} completed the call with data from a mismatched peer")
        for r, evs in events.items():
            slow = [e for e in evs if e["elapsed"] > deadline + 2]
            if slow:
                problems.append(f"{name}: rank {r} took {slow[0]['elapsed']} s")
    assert not problems, "\n".join(problems)


def test_junk_on_listening_ports():
    n = 3
    held, found = [], {}

    def control(world):
        world.wait_keys([f"ready/{r}" for r in range(n)], 90)
        for r in range(n):
            info = json.loads(world.store.get(f"ready/{r}"))
            ports = set(harness.listening_ports(info["pid"]))
            if info.get("port"):
                ports.add(info["port"])
            found[r] = sorted(ports)
            for port in ports:
                held.extend(_attack(port))
        world.store.set("attacked", b"1")
        world.wait_keys([f"phase2/{r}" for r in range(n)], 120)
        for s in held:
            s.close()
        world.store.set("released", b"1")

    try:
        res = harness.run_world("cases_faults", n, args={"scenario": "garbage"}, control=control, timeout=240)
    finally:
        for s in held:
            s.close()
    harness.note(f"junk connections sent to listening ports {found}")
    assert all(found.values()), f"a rank has no listening port to attack: {found}"
    res.assert_ok()


def _attack(port):
    """Junk against one port; returns the sockets left open (half-open connections)."""
    held = []

    def connect():
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.settimeout(2)
        return s

    s = connect()  # random bytes, then close
    s.sendall(os.urandom(64 * 1024))
    s.close()
    s = connect()  # reset right away
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    s = connect()  # a few bytes of a "header", then silence
    s.sendall(os.urandom(7))
    held.append(s)
    s = connect()  # nothing at all
    held.append(s)
    s = connect()  # a plausible-size header of junk, then silence
    s.sendall(os.urandom(64))
    held.append(s)
    s = connect()  # a flood (it may stop being read: never block on it)
    try:
        s.sendall(os.urandom(4 * 2**20))
    except OSError:
        pass
    held.append(s)
    return held
