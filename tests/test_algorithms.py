"""Each selectable algorithm forced through PLAIT_ALGO, in worlds of several sizes."""

import pytest

import harness


@pytest.mark.parametrize("n,segment", [(2, 4096), (3, 4096), (4, None), (5, 4096), (6, 4096), (7, None), (8, 65536)])
def test_forced_algorithms(n, segment):
    env = {"PLAIT_SEGMENT_BYTES": str(segment)} if segment else {}
    res = harness.run_world("cases_algorithms", n, env=env, timeout=400)
    names = res.of(0, "algorithms")
    cases = sum((res.done(r) or {}).get("cases", 0) for r in range(n))
    harness.note(f"forced algorithms n={n} segment={segment or 'default'}: {cases} rank-cases in {res.elapsed:.1f} s"
                 + (f"; {names[0]['names']}" if names and n == 2 else ""))
    res.assert_ok()
