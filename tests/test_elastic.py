"""Elastic mode with real processes on loopback: members found a group and join it, are killed
(-9) or stopped (SIGSTOP) mid-loop, and every result any member returns is checked against the
sum over the members of the view it ran in (`plait.tools.testbed.churn` runs the members and
reads their logs)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import harness
import plait
from plait.tools.testbed.churn import Churn, _events, run_churn

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="stops members with SIGSTOP")

HB = 0.5


def _group(tmp_path, n):
    churn = Churn(n, HB, tmp_path)
    churn.start()
    return churn


def _wait_for(cond, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def _committed_after(churn, t, members):
    """Operations committed after time `t` by `members` (logs), with their views' sizes."""
    out = []
    for m in members:
        out += [e for e in _events(m.log) if e["event"] == "ok" and e["t"] > t]
    return out


def _check(report):
    assert report.wrong == 0, "a member returned a wrong result"
    assert not report.errors, report.errors
    assert report.committed > 0


def test_members_join_at_update_points_and_every_result_is_right(tmp_path):
    churn = _group(tmp_path, 3)
    try:
        _wait_for(lambda: any(e["event"] == "ok" and e["members"] == 3 for e in _events(churn.members[0].log)),
                  20, "an operation over all three members")
        time.sleep(0.5)
    finally:
        churn.finish()
    report = churn.report(0)
    _check(report)
    joined = [next(e for e in _events(m.log) if e["event"] == "joined") for m in churn.members]
    assert [j["epoch"] for j in joined] == sorted(j["epoch"] for j in joined), "each joiner comes in at a later view"
    assert len({j["id"] for j in joined}) == 3
    for m in churn.members:
        assert any(e["event"] == "left" for e in _events(m.log)), "every member left cleanly at the end"


@pytest.mark.parametrize("who", ["member", "leader"])
def test_the_others_go_on_without_a_killed_member(tmp_path, who):
    churn = _group(tmp_path, 4)
    try:
        _wait_for(lambda: any(e["event"] == "ok" and e["members"] == 4 for e in _events(churn.members[-1].log)),
                  20, "an operation over all four members")
        victim = churn.members[0] if who == "leader" else churn.members[2]
        survivors = [m for m in churn.members if m is not victim]
        t = time.time()
        churn.kill(victim, "kill-leader" if who == "leader" else "kill")
        _wait_for(lambda: any(e["members"] == 3 for e in _committed_after(churn, t, survivors)), 10,
                  "an operation over the three survivors")
        recovered = min(e["t"] for e in _committed_after(churn, t, survivors) if e["members"] == 3) - t
        harness.note(f"elastic: {who} killed (-9), 4 members: next committed allreduce over the 3 survivors "
                     f"after {recovered * 1000:.0f} ms")
    finally:
        churn.finish()
    _check(churn.report(0))


def test_a_stopped_member_is_left_out_within_the_heartbeat_timeout_and_learns_it_was_evicted(tmp_path):
    churn = _group(tmp_path, 4)
    try:
        _wait_for(lambda: any(e["event"] == "ok" and e["members"] == 4 for e in _events(churn.members[-1].log)),
                  20, "an operation over all four members")
        victim = churn.members[1]
        survivors = [m for m in churn.members if m is not victim]
        t = time.time()
        churn.stop(victim, 3 * HB)
        _wait_for(lambda: any(e["members"] == 3 for e in _committed_after(churn, t, survivors)), 10,
                  "an operation over the three members left")
        recovered = min(e["t"] for e in _committed_after(churn, t, survivors) if e["members"] == 3) - t
        harness.note(f"elastic: member stopped (SIGSTOP), heartbeat timeout {HB} s: next committed allreduce after "
                     f"{recovered * 1000:.0f} ms")
        time.sleep(3 * HB)
        churn.resume_due()
        _wait_for(lambda: any(e["event"] == "evicted" for e in _events(victim.log)), 10,
                  "the stopped member, resumed, learns it is no longer in the group")
    finally:
        churn.finish()
    _check(churn.report(0))


def test_a_joiner_with_another_token_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_TOKEN", "the group's secret")
    churn = _group(tmp_path, 1)
    try:
        env = dict(os.environ, PLAIT_TOKEN="a guess", PYTHONPATH=os.pathsep.join(sys.path))
        code = ("import plait.elastic, sys\n"
                "try:\n"
                f"    plait.elastic.join([{churn.members[0].contact!r}], listen='127.0.0.1:0', timeout=60)\n"
                "except plait.ConfigError as e:\n"
                "    print(e); sys.exit(3)\n")
        start = time.time()
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 3, p.stdout + p.stderr
        assert "PLAIT_TOKEN" in p.stdout, p.stdout
        assert time.time() - start < 30, "a refusal does not wait for the join timeout"
    finally:
        churn.finish()
    _check(churn.report(0))


def test_elastic_calls_check_their_arguments_and_a_single_member_works_alone():
    import plait.elastic

    comm = plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=HB)
    try:
        assert (comm.rank, comm.world_size, comm.epoch) == (0, 1, 0)
        x = np.arange(7, dtype=np.float32)
        assert np.array_equal(comm.allreduce(x, "avg"), x)
        assert comm.update() is False
        assert comm.should_commit() is True and comm.should_commit(False) is False
        with pytest.raises(plait.InvalidArgumentError):
            comm.send(x, 0)
        with pytest.raises(plait.InvalidArgumentError):
            comm.allreduce(x, async_op=True)
        with pytest.raises(plait.ConfigError):
            plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=0.1)
    finally:
        comm.close()


def test_churn_for_90_seconds_commits_no_wrong_result(tmp_path):
    """Kills, stops and leader kills every 1.5 s while joiners keep four members (`plait testbed
    churn --seconds 90`)."""
    report = run_churn(members=4, seconds=90, every=1.5, hb=HB, workdir=tmp_path)
    d = report.as_dict()
    harness.note(f"elastic churn 90 s: {report.committed} committed, {report.failed} failed, {report.wrong} wrong, "
                 f"{report.kills} kills, {report.stops} stops, {report.joins} joins; recovery p50/p99 ms: "
                 + ", ".join(f"{k} {d[k + '_p50_ms']:.0f}/{d[k + '_p99_ms']:.0f}" for k in sorted(report.recovery_ms))
                 + f"; longest stall {report.longest_stall_ms:.0f} ms")
    _check(report)
    assert report.kills + report.stops >= 30
    assert set(report.recovery_ms) == {"kill", "kill-leader", "stop"}


_COMMIT_WORKER = """
import json, sys, plait.elastic
comm = plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=0.5, timeout=30)  # peers: PLAIT_JOIN
print(json.dumps({"contact": comm.contact}), flush=True)
while comm.world_size < int(sys.argv[1]):
    comm.update()
votes = []
rank = comm.rank  # read now: a member that finishes first leaves, and the others' ranks then shift
for step in range(3):
    votes.append(comm.should_commit(ok=not (step == 1 and rank == 2)))
print(json.dumps({"votes": votes, "rank": rank}), flush=True)
comm.close()
"""


def test_should_commit_is_the_same_on_every_member_and_joiners_find_the_group_through_plait_join():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    founder = subprocess.Popen([sys.executable, "-c", _COMMIT_WORKER, "3"], env=env, stdout=subprocess.PIPE, text=True)
    contact = json.loads(founder.stdout.readline())["contact"]
    joiners = [subprocess.Popen([sys.executable, "-c", _COMMIT_WORKER, "3"], env=dict(env, PLAIT_JOIN=contact),
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in [founder] + joiners:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["rank"] for o in outs) == [0, 1, 2]
    for o in outs:
        assert o["votes"] == [True, False, True], "one member's False makes the step fail everywhere"


_RUN_SCRIPT = """
import plait.elastic
comm = plait.elastic.join(heartbeat_timeout=0.5, timeout=30)
while comm.world_size < 2:
    comm.update()
# the world is read before the call: once the other member has its result it may leave, and the
# view then shrinks under a slower caller's print
world = comm.world_size
x = comm.allreduce(__import__("numpy").ones(3))
print("world", world, "sum", x.tolist(), flush=True)
comm.close()
"""


def test_plait_run_starts_one_member_per_command(tmp_path):
    import socket

    script = tmp_path / "train.py"
    script.write_text(_RUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    cli = [sys.executable, "-m", "plait.tools.cli", "run"]
    founder = subprocess.Popen(cli + ["--listen", f"127.0.0.1:{port}", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    joiner = subprocess.Popen(cli + ["--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", str(script)], env=env,
                              stdout=subprocess.PIPE, text=True)
    for p in (founder, joiner):
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        assert "world 2 sum [2.0, 2.0, 2.0]" in out, out


_PAIR_WORKER = """
import json, sys, time, numpy as np, plait, plait.elastic
witness = sys.argv[1] or None
comm = plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=0.5, timeout=float(sys.argv[2]), witness=witness)
print(json.dumps({"contact": comm.contact, "id": comm.member_id}), flush=True)
end = time.time() + 30
while time.time() < end:
    try:
        comm.update()
        comm.allreduce(np.ones(4))
    except plait.PeerLost:
        continue
    except plait.PlaitError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e), "world": comm.world_size}), flush=True)
        sys.exit(0)
    if comm.world_size == 1 and comm.epoch > 1:
        print(json.dumps({"alone": True, "epoch": comm.epoch}), flush=True)
        sys.exit(0)
"""


@pytest.mark.parametrize("with_witness", [True, False])
def test_two_members_survive_a_crash_with_a_witness_and_wait_without_one(with_witness):
    import plait.elastic

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    env.pop("PLAIT_WITNESS", None)
    w = plait.elastic.witness("127.0.0.1:0", heartbeat_timeout=HB) if with_witness else None
    try:
        args = [w.contact if w else "", "4"]
        founder = subprocess.Popen([sys.executable, "-c", _PAIR_WORKER, *args], env=env, stdout=subprocess.PIPE, text=True)
        contact = json.loads(founder.stdout.readline())["contact"]
        joiner = subprocess.Popen([sys.executable, "-c", _PAIR_WORKER, "", "4"], env=dict(env, PLAIT_JOIN=contact),
                                  stdout=subprocess.PIPE, text=True)
        joiner_id = json.loads(joiner.stdout.readline())["id"]
        if w:
            _wait_for(lambda: w.view()[1] == 2, 20, "the witness learns the two-member view")
        time.sleep(0.5)
        joiner.kill()
        joiner.wait()
        start = time.time()
        out, _ = founder.communicate(timeout=60)
        last = json.loads(out.strip().splitlines()[-1])
        if with_witness:
            assert last.get("alone"), last
            assert time.time() - start < 5
        else:
            assert last["error"] == "PlaitTimeoutError", last
            assert "majority" in last["message"], last["message"]
            assert f"unreachable: member {joiner_id}" in last["message"], last["message"]  # the error names whom
    finally:
        if w:
            w.close()


_SCENARIOS = Path(__file__).resolve().parent / "elastic_scenarios"


def _scenario(name, roles, tmp_path, timeout=90, wait_for=None):
    """Runs one process per role; waits for the roles in `wait_for` (default: all), then kills
    the others (a role may have stopped itself)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    procs = {r: subprocess.Popen([sys.executable, str(_SCENARIOS / f"{name}.py"), r, str(tmp_path)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in roles}
    wait_for = wait_for or roles
    out = {}
    try:
        for r in list(wait_for) + [r for r in roles if r not in wait_for]:
            p = procs[r]
            if r not in wait_for:
                os.kill(p.pid, signal.SIGKILL)
            o, e = p.communicate(timeout=timeout)
            out[r] = [json.loads(line) for line in o.splitlines() if line.startswith("{")]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    return out


def test_a_joiner_that_gives_up_does_not_turn_every_update_into_a_view_change(tmp_path):
    out = _scenario("stale_pending", ["A", "B", "J"], tmp_path)
    assert out["J"] and out["J"][-1]["ev"] == "join_failed"
    for r in ("A", "B"):
        assert len(out[r]) == 6, out[r]
        assert not any(e["changed"] for e in out[r]), out[r]
        assert out[r][-1]["pending"] == 0, "the joiner that went away is forgotten everywhere"


def test_a_member_stopped_while_a_mesh_is_built_costs_a_heartbeat_timeout_not_the_operation_timeout(tmp_path):
    out = _scenario("boot_stall", ["A", "B", "C"], tmp_path, wait_for=["A", "B"])
    for r in ("A", "B"):
        last = out[r][-1]
        assert last["ev"] == "err" and last["kind"] == "PeerLost", last
        assert last["took"] < 10, f"{r} waited {last['took']} s (heartbeat timeout 1 s, operation timeout 20 s)"
        assert "no member" not in last["msg"], "the error names the member that was lost"


_STORE_WORKER = """
import json, os, sys, numpy as np, plait, plait.elastic
stop = sys.argv[1]
comm = plait.elastic.join(heartbeat_timeout=0.5, timeout=30, listen="127.0.0.1:0")  # PLAIT_JOIN_STORE
seen = None
while not os.path.exists(stop):
    try:
        comm.update()
        comm.allreduce(np.ones(2))
    except plait.PeerLost:
        continue
    now = (comm.epoch, comm.members)
    if now != seen:
        seen = now
        print(json.dumps({"id": comm.member_id, "epoch": comm.epoch, "members": comm.members}), flush=True)
comm.close()
"""


def test_processes_started_alike_find_one_group_through_a_store_and_a_gone_group_is_founded_anew(tmp_path):
    """Every process runs the same command with PLAIT_JOIN_STORE: of those started at once, one
    founds and the others join; after the founder is killed a newcomer still finds the group (the
    most senior survivor keeps the record); once every member is gone, the next process founds a
    new group instead of dialling the dead ones until its timeout."""
    pytest.importorskip("torch")
    from plait._store import tcp_store

    server = tcp_store("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stop = tmp_path / "stop"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PLAIT_JOIN_STORE=f"127.0.0.1:{server.port}")
    env.pop("PLAIT_JOIN", None)
    procs, views = [], {}

    import queue
    import threading

    lines = {}

    def start():
        p = subprocess.Popen([sys.executable, "-c", _STORE_WORKER, str(stop)], env=env, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        lines[p] = queue.Queue()
        threading.Thread(target=lambda: [lines[p].put(x) for x in p.stdout] + [lines[p].put("")], daemon=True).start()
        return p

    def latest(p, want):
        """Reads `p`'s views until one with `want` members (a silent worker fails the test, not hangs it)."""
        end = time.time() + 30
        while time.time() < end:
            try:
                line = lines[p].get(timeout=max(0.01, end - time.time()))
            except queue.Empty:
                break
            if not line:
                break
            v = json.loads(line)
            views[p] = v
            if len(v["members"]) == want:
                return v
        raise AssertionError(f"no view of {want} members from {p.args}: last {views.get(p)}")

    try:
        first = [start() for _ in range(3)]
        got = [latest(p, 3) for p in first]
        assert len({tuple(v["members"]) for v in got}) == 1, f"more than one group was founded: {got}"
        founder = next(p for p, v in zip(first, got) if v["id"] == v["members"][0])
        founder.kill()
        newcomer = start()
        joined = latest(newcomer, 3)
        survivors = [p for p in first if p is not founder]
        assert {views[p]["id"] for p in survivors} <= set(joined["members"]), joined
        for p in survivors + [newcomer]:
            p.kill()
        last = start()
        alone = latest(last, 1)
        assert alone["epoch"] == 0 and alone["members"] == [alone["id"]], alone
    finally:
        stop.touch()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


_MISMATCH_WORKER = """
import json, sys, time, numpy as np, plait, plait.elastic
comm = plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=0.5, timeout=20)
print(json.dumps({"contact": comm.contact}), flush=True)
while comm.world_size < 2:
    comm.update()
start = time.time()
try:
    comm.allreduce_with_retry(np.ones(4 if comm.rank == 0 else 8, np.float32))   # a program error: the sizes differ
    print(json.dumps({"error": None}), flush=True)
except plait.PlaitError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e), "seconds": time.time() - start}), flush=True)
"""


def test_members_whose_calls_differ_get_that_error_instead_of_retrying_for_ever():
    results = [lines[-1] for lines in harness.elastic_group(_MISMATCH_WORKER, [[], []], timeout=60)]
    for r in results:
        assert r["error"] in ("MismatchError", "PeerError"), r
        assert "mismatch" in r["message"] and r["seconds"] < 10, r
