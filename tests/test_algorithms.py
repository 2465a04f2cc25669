"""Each selectable algorithm forced through PLAIT_ALGO, in worlds of several sizes.

Each world runs once; test_forced_algorithms[n] checks the world as a whole, test_case[nN-GROUP]
one group of its cases (plan.py: an algorithm x collective x dtype x op), reported by name."""

import pytest

import cases_algorithms as ca
import harness
import plan

SEGMENTS = {2: 4096, 3: 4096, 4: None, 5: 4096, 6: 4096, 7: None, 8: 65536}
# Two worlds run their rings in another order than the ranks' (PLAIT_RING_ORDER): the schedules
# relabelled for it must compute what the rank-order ones do.
RING_ORDERS = {5: "0,3,1,4,2", 8: "0,5,2,7,4,1,6,3"}
PLANS = {n: plan.groups(ca.plan(n)) for n in SEGMENTS}
PLANNED = {n: {name for names in groups.values() for name in names} for n, groups in PLANS.items()}


def _start(n):
    env = {"PLAIT_SEGMENT_BYTES": str(SEGMENTS[n])} if SEGMENTS[n] else {}
    if n in RING_ORDERS:
        env["PLAIT_RING_ORDER"] = RING_ORDERS[n]
    return harness.run_world("cases_algorithms", n, env=env, timeout=400)


worlds = harness.Worlds(_start)


@pytest.mark.parametrize("n,segment", list(SEGMENTS.items()))
def test_forced_algorithms(n, segment):
    res = worlds.get(n)
    names = res.of(0, "algorithms")
    cases = sum((res.done(r) or {}).get("cases", 0) for r in range(n))
    harness.note(f"forced algorithms n={n} segment={segment or 'default'}"
                 + (f" ring order {RING_ORDERS[n]}" if n in RING_ORDERS else "") + f": {cases} rank-cases in {res.elapsed:.1f} s"
                 + (f"; {names[0]['names']}" if names and n == 2 else ""))
    res.assert_ok(cases=PLANNED[n])


@pytest.mark.parametrize("n,group", [(n, g) for n in PLANS for g in PLANS[n]],
                         ids=[f"n{n}-{g}" for n in PLANS for g in PLANS[n]])
def test_case(n, group):
    harness.assert_cases(worlds.get(n), PLANS[n][group], PLANNED[n])
