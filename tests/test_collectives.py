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


def test_collectives_over_several_streams():
    """PLAIT_STREAMS=3 with 128 KiB segments: large payloads take three connections per peer in
    turn and arrive in any order; every result, and the order of messages with one tag, holds."""
    n = 3
    env = {"PLAIT_STREAMS": "3", "PLAIT_SEGMENT_BYTES": "131072",
           "PLAIT_TEST_SECTIONS": "streams,allreduce,big,async,p2p,bit_identical"}
    res = harness.run_world("cases_collectives", n, env=env, timeout=400)
    res.assert_ok()
    harness.assert_same_digests(res)
    for r in range(n):
        seen = res.of(r, "metric")
        streams = [e["streams"] for e in seen if e["name"] == "streams"]
        assert streams == [[3] * (n - 1)], f"rank {r} reports streams per peer {streams}"
