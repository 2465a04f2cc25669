"""DiLoCo (plait.diloco) on elastic members: the outer step equals a numpy reference of the DiLoCo
update in sync, async and streaming modes, async applies every round exactly once, and the outer
state stays bit-identical through a join and a crash."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import harness

D, H, ROUNDS, LR, MU, INNER_LR = 10, 3, 4, 0.7, 0.9, 0.1

_WORKER = r"""
import hashlib, json, os, sys, time, torch
import plait, plait.elastic
from plait.diloco import DiLoCo

mode, want, rounds, die_at, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
D, H = 10, 3
comm = plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=2, timeout=30)
give_up = time.time() + 60
print(json.dumps({"contact": comm.contact, "id": comm.member_id}), flush=True)

class Point(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, D))
model = Point()
inner = torch.optim.SGD(model.parameters(), lr=0.1)
diloco = DiLoCo(model, inner, comm, outer_lr=0.7, outer_momentum=0.9, every=H, mode=mode,
                fragments=2 if mode == "streaming" else 1)
targets, slept, first = {}, False, None
# One loop, one update() per iteration, as in training: a step is taken only when the view (the
# same on every member) is as large as wanted, so every member makes the same calls.
while diloco.inner_steps < rounds * H and time.time() < give_up:
    diloco.update()                                 # a joiner's first: the update point that admitted it
    first = diloco.inner_steps if first is None else first
    if diloco.inner_steps == 0:
        need = start                                # the first ones start together
    elif mode == "async":
        # The update point of async mode is the end of a round: give the late joiner time to
        # be waiting by the end of round 2, where it joins that round's average.
        if want > 3 and diloco.inner_steps == H and not slept:
            time.sleep(5)
            slept = True
        need = 1
    else:
        # the late joiner is awaited after round 1 (by the members: it has joined when it gets here)
        need = want if diloco.inner_steps == H and first == 0 else 1
    if comm.world_size < need:
        continue
    rank = comm.rank
    targets.setdefault(diloco.inner_steps, rank)
    target = torch.full((D,), float(rank + 1))
    loss = 0.5 * ((model.w - target) ** 2).sum()
    loss.backward()
    diloco.step()
    diloco.zero_grad()
    if diloco.inner_steps == die_at:
        os._exit(0)
diloco.finish()
digest = hashlib.sha256(diloco.outer.numpy().tobytes() + diloco.momentum.numpy().tobytes()).hexdigest()
print(json.dumps({"rank": comm.rank, "outer": diloco.outer.tolist(), "local": model.w.detach().tolist(),
                  "rounds": diloco.rounds, "digest": digest, "targets": targets, "world": comm.world_size,
                  "bytes": diloco.bytes_sent, "first": first,
                  "during": diloco.steps_during_catchup}), flush=True)
comm.barrier()
comm.close()
"""


def _group(mode, n=3, die_at=0, late=False):
    """n members run `mode`; with `die_at`, the last started dies after that inner step; with
    `late`, one more joins after the first round. Returns the survivors' final lines."""
    want = n + 1 if late else n
    args = [[mode, want, ROUNDS, die_at if i == n - 1 else 0, n] for i in range(n)]
    results = harness.elastic_group(_WORKER, args, late=[[mode, want, ROUNDS, 0, n]] if late else [])
    return [lines[-1] for lines in results if lines and "outer" in lines[-1]]


def _outer_step(outer, m, g):
    m = MU * m + g
    return outer - LR * (g + MU * m), m


def _reference(mode, n, joiner=False):
    """The DiLoCo update in numpy: member r pulls its parameters towards r + 1 with SGD. With
    `joiner` (sync and streaming), member n is admitted after round 1: it sits out round 2 (weight
    0: the averages are the members' alone) and trains from round 3 on."""
    outer = np.linspace(-1.0, 1.0, D).astype(np.float32).astype(np.float64)
    m = np.zeros(D)
    local = [outer.copy() for _ in range(n)]
    pending = None
    frags = [slice(0, 5), slice(5, 10)] if mode == "streaming" else [slice(None)]
    for t in range(1, ROUNDS * H + 1):
        if joiner and t == 2 * H + 1:
            local.append(outer.copy())
        for r in range(len(local)):
            local[r] = local[r] - INNER_LR * (local[r] - (r + 1))
        offset = t % H or H
        due = [sl for f, sl in enumerate(frags) if offset == (f + 1) * H // len(frags)] if mode == "streaming" else \
              ([slice(None)] if t % H == 0 else [])
        for sl in due:
            avg = np.mean([outer[sl] - local[r][sl] for r in range(len(local))], axis=0)
            if mode == "async":
                if pending is not None:
                    outer, m = _outer_step(outer, m, pending)
                    local = [outer.copy() for _ in range(n)]
                pending = avg
                continue
            o, mm = _outer_step(outer[sl], m[sl], avg)
            outer, m = outer.copy(), m.copy()
            outer[sl], m[sl] = o, mm
            for r in range(len(local)):
                local[r][sl] = outer[sl]
    if mode == "async" and pending is not None:
        outer, m = _outer_step(outer, m, pending)
    return outer


@pytest.mark.parametrize("mode", ["sync", "async", "streaming"])
def test_the_outer_step_equals_the_numpy_reference_and_every_member_ends_bit_identical(mode):
    outs = _group(mode)
    assert len(outs) == 3
    assert len({o["digest"] for o in outs}) == 1, "the members' outer states differ"
    assert all(o["rounds"] == ROUNDS for o in outs), [o["rounds"] for o in outs]  # async: each round applied once
    ref = _reference(mode, 3)
    np.testing.assert_allclose(outs[0]["outer"], ref, rtol=1e-5, atol=1e-5)
    if mode != "async":
        assert all(o["bytes"] == ROUNDS * 4 * D for o in outs)        # f32: the whole vector once per round


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_outer_state_stays_bit_identical_through_a_join_and_a_crash(mode):
    outs = _group(mode, n=3, die_at=H + 1, late=True)
    assert len(outs) == 3, outs                                       # two of the first three, and the joiner
    assert len({o["digest"] for o in outs}) == 1, "the members' outer states differ"
    assert len({o["rounds"] for o in outs}) == 1 and outs[0]["rounds"] == ROUNDS, [o["rounds"] for o in outs]
    assert all(o["world"] == 3 for o in outs)
    assert all(o["outer"] == o["local"] for o in outs)                # after the last round: local = outer


@pytest.mark.parametrize("mode", ["sync", "streaming"])
def test_a_joiner_sits_out_the_round_it_joins_in_with_weight_0_and_then_trains(mode):
    outs = _group(mode, n=2, late=True)
    assert len(outs) == 3, outs
    assert len({o["digest"] for o in outs}) == 1, "the members' outer states differ"
    assert sorted(o["first"] for o in outs) == [0, 0, H]                # the joiner came in after round 1
    assert all(o["rounds"] == ROUNDS for o in outs), [o["rounds"] for o in outs]
    np.testing.assert_allclose(outs[0]["outer"], _reference(mode, 2, joiner=True), rtol=1e-5, atol=1e-5)
    joiner = next(o for o in outs if o["first"] == H)
    assert joiner["bytes"] == (ROUNDS - 1) * 4 * D                      # it took part in every average after it joined
    # The members took the round's steps up to its first average with the catch-up under way (it
    # was not waited for at the update point); the joiner synced in the foreground.
    first_average = H // 2 if mode == "streaming" else H
    assert sorted(o["during"] for o in outs) == [0, first_average, first_average], outs


def test_the_readme_example_trains_ddp_and_diloco_and_diloco_sends_far_fewer_bytes(tmp_path):
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "diloco_train.py")
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, example, "--members", "2", "--steps", "100", "--configs", "ddp,diloco-50-int8",
                        "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    ddp, diloco = json.loads(out.read_text())
    assert ddp["final_loss"] < ddp["curve"][0][1] and diloco["final_loss"] < diloco["curve"][0][1]   # both learn
    assert ddp["bytes"] / diloco["bytes"] > 150                      # 50 steps per round, int8 on the wire
