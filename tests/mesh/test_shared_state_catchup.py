"""A joiner's shared state download on a testbed (`plait testbed catchup`): every byte arrives,
and it is striped evenly over all the holders, each on its own rate-limited cable."""

import harness
from plait.tools.testbed.catchup import run


def test_a_joiner_downloads_from_every_holder_each_on_its_own_cable(tmp_path):
    size = 24 << 20
    results = run([1, 3], size, "200mbit", tmp_path)
    harness.note("shared state catch-up, 24 MiB over 200 Mbit/s cables: " + ", ".join(
        f"{r['holders']} holder(s) {r['sync_seconds']:.2f} s ({r['received_gbit_s']:.2f} Gbit/s)" for r in results))
    for r in results:
        assert r["fetched_bytes"] == size, r
        assert r["sources"] == r["holders"], r
        shares = r["bytes_per_source"]
        assert max(shares) - min(shares) <= 4 << 20, r            # within one chunk of an even split
