"""The testbed's WAN cables (plait.tools.testbed.wan): a userspace delay line on TUN ends gives a
cable the round trip and the rate of its spec, its loss rate, and a veth-like carrier; the rest of
the testbed is unchanged, and `down` removes the forwarders, also when nobody called down() on
the testbed object."""

import os
import re
import statistics
import subprocess
import time

from plait.tools import testbed
from plait.tools.testbed import Testbed, cable_addr, cable_iface, wan


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_wan_cable_round_trip_rate_loss_and_carrier():
    """Acceptance of the delay line on a loaded 2-core machine: the median of 9 pings within 10 %
    (+1 ms) of twice the one-way delay and never below it, a TCP stream's rate (after 2 s of slow
    start) within 15 % of the goodput the configured rate allows and not above it."""
    tb = Testbed(3, name="pltestwan", link_rate=None, lan_rate=None,
                 wan="0-1 20ms 200mbit, 1-2 2ms loss=30%/0")
    tb.up()
    try:
        # same names and addresses as a veth cable, and the TUN ends say they are 10 Gbit/s like veth
        p = subprocess.run(["ip", "-n", tb.ns(1), "-o", "addr", "show", "dev", cable_iface(1, 0)],
                           capture_output=True, text=True, check=True)
        assert f"{cable_addr(1, 0)}/24" in p.stdout
        p = subprocess.run(["ip", "netns", "exec", tb.ns(0), "cat", f"/sys/class/net/{cable_iface(0, 1)}/speed"],
                           capture_output=True, text=True)
        assert p.stdout.strip() == str(testbed.VETH_SPEED_MBPS), p.stdout + p.stderr

        r = wan.ping(tb, 0, 1, count=9, interval=0.05)
        assert r["lost"] == 0, r
        med = statistics.median(r["rtt_ms"])
        assert 40.0 <= med <= 40.0 * 1.10 + 1.0, r["rtt_ms"]
        fast = statistics.median(wan.ping(tb, 0, 2, count=5, interval=0.01)["rtt_ms"])
        assert fast < 5.0, "the veth cable 0-2 has no delay"

        t = wan.tcp_stream(tb, 0, 1, seconds=5.0, warmup=2.0)
        want = wan.goodput(200e6)
        assert 0.85 * want <= t["bps"] <= 1.03 * want, f"{t['bps'] / 1e6:.1f} Mbit/s for {want / 1e6:.1f}"

        # 30 % loss from node 1 to node 2, none back: about 12 of 40 echo requests lost
        lossy = wan.ping(tb, 1, 2, count=40, interval=0.01, wait=0.3)
        assert 3 <= lossy["lost"] <= 25, lossy

        # a WAN end taken down: the other end loses its carrier (as with veth), and gets it back
        def carrier(node, peer):
            out = subprocess.run(["ip", "-n", tb.ns(node), "-o", "link", "show", cable_iface(node, peer)],
                                 capture_output=True, text=True).stdout
            return "NO-CARRIER" not in out and re.search(r"<[^>]*LOWER_UP", out) is not None

        tb.set_cable(0, 1, up=False)
        deadline = time.monotonic() + 3
        while carrier(1, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not carrier(1, 0)
        assert wan.ping(tb, 1, 0, count=2, interval=0.01, wait=0.5)["lost"] == 2
        tb.set_cable(0, 1, up=True)
        deadline = time.monotonic() + 3
        while not carrier(1, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert carrier(1, 0)
        assert wan.ping(tb, 1, 0, count=3, interval=0.01)["lost"] == 0

        # recorded in the state file, so `plait testbed down` finds them after a crash too
        pids = [f["pid"] for f in tb._state["forwarders"]]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        tb._state = None  # as if this process had died: only the state file is left
    finally:
        testbed.down("pltestwan")
    for proc in tb._procs:
        proc.wait(timeout=5)
    assert not any(_alive(p) for p in pids)
    assert not [f for f in os.listdir(testbed.STATE_DIR) if f.startswith("pltestwan")]
