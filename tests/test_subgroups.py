"""Direct-API subgroups sharing their owner's connections: concurrent use, ranks, p2p, refusals.
Faults on subgroups are in test_faults.py (a killed rank) and the core's tests/subgroups.rs."""

import pytest

import harness


@pytest.mark.parametrize("n", [2, 3, 5])
def test_subgroups_on_shared_links(n):
    res = harness.run_world("cases_subgroups", n, timeout=120)
    res.assert_ok()
