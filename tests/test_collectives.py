"""Every collective against numpy, one world per size (see cases_collectives.py for the cases)."""

import pytest

import harness


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_collectives(n):
    # The 3-rank world meets through torch's TCPStore; the others through the light test store.
    res = harness.run_world("cases_collectives", n, store="torch" if n == 3 else "py",
                            timeout=400)
    cases = sum((res.done(r) or {}).get("cases", 0) for r in range(n))
    b2b = [e for e in res.of(0, "metric") if e["name"] == "back_to_back"]
    harness.note(f"collectives n={n}: {cases} rank-cases in {res.elapsed:.1f} s"
                 + (f"; back-to-back small allreduce {b2b[0]['us_per_op']} us/op" if b2b else ""))
    res.assert_ok()
    harness.assert_same_digests(res)
