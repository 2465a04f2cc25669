"""Shared state (elastic mode): every member's state bit-identical after a sync, the winner chosen
by the members that synced before, corrupted chunks repaired alone, a joiner's download striped
over every holder, and continued from the others when a holder dies mid-download."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import harness
from plait._shared_state import plan, winner

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32
LAYOUT = b"L" * 32


def test_the_state_most_voters_hold_wins_ties_go_to_the_senior_and_joiners_never_vote():
    assert winner([(LAYOUT, A, True), (LAYOUT, B, True), (LAYOUT, B, True)]) == 1
    assert winner([(LAYOUT, A, True), (LAYOUT, B, True)]) == 0                  # a tie: the most senior voter
    assert winner([(LAYOUT, A, True), (LAYOUT, B, False), (LAYOUT, B, False), (LAYOUT, B, False)]) == 0
    assert winner([(LAYOUT, A, False), (LAYOUT, B, False), (LAYOUT, C, True)]) == 2
    assert winner([(LAYOUT, A, False), (LAYOUT, B, False)]) == 0                # nobody synced yet: rank 0


def test_a_joiners_download_is_striped_over_every_holder_and_rounds_are_bounded():
    n_chunks = 12
    table = [[A] * n_chunks for _ in range(3)] + [[B] * n_chunks]   # three holders, one joiner
    table[1][4] = C                                                 # member 1 lacks chunk 4 too
    sizes = [100] * n_chunks
    rounds = plan(table, 0, sizes, round_bytes=250)
    moves = [t for r in rounds for t in r]
    assert sorted((k, dst) for k, _, dst in moves) == sorted([(k, 3) for k in range(n_chunks)] + [(4, 1)])
    assert all(table[src][k] == table[0][k] for k, src, _ in moves)          # only holders send
    sources = [src for k, src, dst in moves if dst == 3]
    assert sorted(set(sources)) == [0, 1, 2]
    assert max(sources.count(s) for s in (0, 1, 2)) - min(sources.count(s) for s in (0, 1, 2)) <= 1
    for r in rounds:
        for dst in range(4):
            got = [sizes[k] for k, _, d in r if d == dst]
            assert sum(got) <= 250 or len(got) == 1
    assert plan([[A] * n_chunks] * 3, 0, sizes, 250) == []                  # nothing differs: nothing moves


_WORKER = r"""
import hashlib, json, os, sys, numpy as np
import plait, plait.elastic
from plait.elastic import SharedState

quit_at, late = int(sys.argv[1]), sys.argv[2] == "late"
comm = plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=0.5, timeout=30)
print(json.dumps({"contact": comm.contact, "id": comm.member_id}), flush=True)
rng = np.random.default_rng(int(comm.member_id, 16) % 2**32)
w = rng.standard_normal((24 << 20) // 4).astype(np.float32)         # 24 MiB: 24 chunks of 1 MiB
step = np.array([int(comm.member_id, 16) % 1000], np.int64)
state = SharedState({"w": w, "step": step}, chunk_bytes=1 << 20)
digest = lambda: hashlib.sha256(w.tobytes() + step.tobytes()).hexdigest()
out = lambda **k: print(json.dumps(dict(k, rank=comm.rank, id=comm.member_id, digest=digest())), flush=True)
if not late:
    while comm.world_size < 3:
        comm.update()
    before = digest()
    r = comm.sync_shared_state(state, round_bytes=2 << 20)
    out(phase="first", report=r, before=before)
    if comm.rank == 2:
        w[5 * (1 << 18) + 3] += 1.0                                 # corrupt one byte range of chunk 5
    r = comm.sync_shared_state(state, round_bytes=2 << 20)
    out(phase="repair", report=r)
    if quit_at and comm.rank == 1:
        real, calls = comm.alltoall_v, [0]
        def dying(*a, **k):
            calls[0] += 1
            if calls[0] == quit_at:
                os._exit(0)                                         # a holder dies mid-download
            return real(*a, **k)
        comm.alltoall_v = dying
    while comm.world_size < 4:
        comm.update()
if late:
    comm.update()                                                   # True at once: the update point that admitted it
r = comm.sync_shared_state(state, round_bytes=2 << 20)
out(phase="join", report=r)
comm.barrier()
comm.close()
"""


def _lines(p, timeout):
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out
    return [json.loads(l) for l in out.strip().splitlines()]


def test_members_converge_on_one_state_repair_a_corrupted_chunk_and_feed_a_joiner_from_every_holder():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    env.pop("PLAIT_JOIN_STORE", None)
    start = lambda joining=None, late=False: subprocess.Popen([sys.executable, "-c", _WORKER, "4", "late" if late else "early"],
                                                  env=dict(env, PLAIT_JOIN=joining) if joining else env,
                                                  stdout=subprocess.PIPE, text=True)
    procs = [start()]
    try:
        first = json.loads(procs[0].stdout.readline())
        procs += [start(first["contact"]) for _ in range(2)]
        ids = [first["id"]] + [json.loads(p.stdout.readline())["id"] for p in procs[1:]]
        first_lines = {}
        for p in procs:                                             # wait for the repair phase of the three
            for _ in range(2):
                line = json.loads(p.stdout.readline())
                first_lines.setdefault(line["phase"], []).append(line)
        procs.append(start(first["contact"], late=True))             # the late joiner
        results = [_lines(p, 120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    # 1. the first sync: nobody voted yet, so the founder's state won and every member holds it
    firsts = first_lines["first"]
    founder = next(l for l in firsts if l["id"] == ids[0])
    assert {l["digest"] for l in firsts} == {founder["before"]}
    assert all(l["report"]["winner"] == ids[0] for l in firsts)
    # 2. one corrupted chunk: outvoted, and only it is fetched
    repairs = first_lines["repair"]
    assert len({l["digest"] for l in repairs}) == 1
    assert sorted(l["report"]["fetched_chunks"] for l in repairs) == [0, 0, 1]
    # 3. the joiner: every byte fetched, striped over the three holders; holder rank 1 died at its
    # fourth transfer round, and the download went on from the other two
    joins = [r[-1] for r in results if r and r[-1].get("phase") == "join"]
    joiner = next(l for l in joins if l["id"] not in ids)
    rep = joiner["report"]
    assert rep["attempts"] == 2, rep
    assert rep["fetched_bytes"] == (24 << 20) + 8, rep
    assert len(rep["sources"]) == 3, rep                          # all three holders sent, the dead one too
    assert len(joins) == 3 and len({l["digest"] for l in joins}) == 1, joins


_LIAR = r"""
import json, sys, numpy as np
import plait, plait.elastic
from plait.elastic import SharedState

comm = plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=0.5, timeout=30)
print(json.dumps({"contact": comm.contact}), flush=True)
founder = comm.world_size == 1
w = np.full(3 << 18, 1.0 if founder else 2.0, np.float32)          # 3 chunks of 1 MiB
state = SharedState({"w": w}, chunk_bytes=1 << 20)
if founder:
    real = state.chunk
    state.chunk = lambda k: real(k) + 1 if k == 1 else real(k)       # sends chunk 1 other than it hashed it
    while comm.world_size < 2:
        comm.update()
else:
    comm.update()
try:
    comm.sync_shared_state(state)
    print(json.dumps({"error": None}), flush=True)
except plait.PeerError as e:
    print(json.dumps({"error": str(e), "w": [float(w[0]), float(w[1 << 18]), float(w[2 << 18])]}), flush=True)
comm.close()
"""


def test_a_chunk_that_arrives_other_than_announced_is_not_written_and_every_member_is_told():
    results = [lines[-1] for lines in harness.elastic_group(_LIAR, [[], []], timeout=60)]
    for r in results:
        assert r["error"] and "another hash than their sender announced" in r["error"], r
    assert results[0]["w"] == [1.0, 1.0, 1.0]
    assert results[1]["w"] == [1.0, 2.0, 1.0], results[1]        # the two good chunks written, the bad one kept as it was
