"""Every collective against numpy, one world per size (see cases_collectives.py for the cases).

Each world runs once; test_collectives[n] checks the world as a whole (every rank finished, no
failure outside a case, the same bits everywhere) and test_case[nN-GROUP] one group of cases
(plan.py), so a failing case is reported by name."""

import pytest

import cases_collectives as cc
import harness
import plan

SIZES = (1, 2, 3, 4, 5, 8)
STREAMS = {"PLAIT_STREAMS": "3", "PLAIT_SEGMENT_BYTES": "131072",
           "PLAIT_TEST_SECTIONS": "streams,allreduce,big,async,p2p,bit_identical"}
# world key -> (n, keyword arguments of run_world, the sections it runs: None for
# PLAIT_TEST_SECTIONS, as the worker reads it). The 3-rank world meets through torch's TCPStore;
# the others through the light test store.
WORLDS = {f"n{n}": (n, {"store": "torch" if n == 3 else "py"}, None) for n in SIZES}
WORLDS["streams"] = (3, {"env": STREAMS}, STREAMS["PLAIT_TEST_SECTIONS"])
PLANS = {key: plan.groups(cc.plan(n, only)) for key, (n, _, only) in WORLDS.items()}
PLANNED = {key: {name for names in groups.values() for name in names} for key, groups in PLANS.items()}


def _start(key):
    n, kwargs, _ = WORLDS[key]
    return harness.run_world("cases_collectives", n, timeout=400, **kwargs)


worlds = harness.Worlds(_start)


@pytest.mark.parametrize("n", SIZES)
def test_collectives(n):
    res = worlds.get(f"n{n}")
    cases = sum((res.done(r) or {}).get("cases", 0) for r in range(n))
    b2b = [e for e in res.of(0, "metric") if e["name"] == "back_to_back"]
    harness.note(f"collectives n={n}: {cases} rank-cases in {res.elapsed:.1f} s"
                 + (f"; back-to-back small allreduce {b2b[0]['us_per_op']} us/op" if b2b else ""))
    res.assert_ok(cases=PLANNED[f"n{n}"])
    harness.assert_same_digests(res)


def test_collectives_over_several_streams():
    """PLAIT_STREAMS=3 with 128 KiB segments: large payloads take three connections per peer in
    turn and arrive in any order; every result, and the order of messages with one tag, holds."""
    res = worlds.get("streams")
    res.assert_ok(cases=PLANNED["streams"])
    harness.assert_same_digests(res)
    for r in range(res.n):
        seen = res.of(r, "metric")
        streams = [e["streams"] for e in seen if e["name"] == "streams"]
        assert streams == [[3] * (res.n - 1)], f"rank {r} reports streams per peer {streams}"


@pytest.mark.parametrize("key,group", [(k, g) for k in WORLDS for g in PLANS[k]], ids=lambda v: v)
def test_case(key, group):
    harness.assert_cases(worlds.get(key), PLANS[key][group], PLANNED[key])
