"""The testbed's WAN spec (plait.tools.testbed.wan): the text and file forms, per-direction values,
defaults and errors. Needs no root: nothing is built (tests/mesh/test_wan.py builds one)."""

import json

import pytest

from plait.tools.testbed import Testbed, TestbedError
from plait.tools.testbed import wan

MS = 1e-3


def test_text_form_three_cables():
    c = wan.resolve(wan.parse_wan("0-1 40ms 200mbit, 1-2 5ms 1gbit, 0-2 80ms 50mbit"), 10**9)
    assert sorted(c) == [(0, 1), (0, 2), (1, 2)]
    ij, ji = c[(0, 1)]
    assert ij.delay == ji.delay == pytest.approx(40 * MS) and ij.rate == ji.rate == 200_000_000 and ij.loss == 0
    # default queue: one bandwidth-delay product of the round trip
    assert ij.queue == int(200e6 / 8 * 0.080)
    assert c[(0, 2)][0].rate == 50_000_000 and c[(0, 2)][0].delay == pytest.approx(80 * MS)
    assert c[(1, 2)][0].queue == int(1e9 / 8 * 0.010)


def test_directions_units_and_keywords():
    c = wan.resolve(wan.parse_wan("1-0 5ms/10ms 1gbit/100mbit loss=0.1%/0 queue=2mb"), None)
    there, back = c[(0, 1)]  # 0->1, 1->0: the spec named 1->0 first
    assert there.delay == pytest.approx(10 * MS) and there.rate == 100_000_000 and there.loss == 0
    assert back.delay == pytest.approx(5 * MS) and back.rate == 10**9 and back.loss == pytest.approx(0.001)
    assert there.queue == back.queue == 2 << 20
    c = wan.resolve(wan.parse_wan("0-1 40 ms 200 Mbit/s loss 1%; 0-2 delay=150us rate=none queue=20ms"), 10**9)
    assert c[(0, 1)][0].delay == pytest.approx(40 * MS) and c[(0, 1)][0].rate == 200_000_000
    assert c[(0, 1)][1].loss == pytest.approx(0.01)
    assert c[(0, 2)][0].delay == pytest.approx(150e-6) and c[(0, 2)][0].rate is None and c[(0, 2)][0].queue is None
    c = wan.resolve(wan.parse_wan("0-1 20ms queue=20ms"), 10**9)  # no rate: the testbed's link rate
    assert c[(0, 1)][0].rate == 10**9 and c[(0, 1)][0].queue == int(1e9 / 8 * 0.020)
    small = wan.resolve(wan.parse_wan("0-1 100us 100mbit"), None)[(0, 1)][0]
    assert small.queue == wan.MIN_QUEUE


def test_file_forms(tmp_path):
    text = tmp_path / "wan.txt"
    text.write_text("# sites\n0-1 40ms 200mbit   # A-B\n1-2 5ms 1gbit\n\n0-2 80ms 50mbit loss=0.5%\n")
    js = tmp_path / "wan.json"
    js.write_text(json.dumps({"0-1": {"delay": "40ms", "rate": "200mbit"}, "1-2": {"delay": "5ms", "rate": "1gbit"},
                              "0-2": {"delay": "80ms", "rate": "50mbit", "loss": "0.5%"}}))
    a = wan.parse_wan(str(text))
    assert a == wan.parse_wan("@" + str(text)) == wan.parse_wan(str(js))
    assert a[(0, 2)][0].loss == pytest.approx(0.005)
    lst = [{"link": "2-1", "delay": ["5ms", "7ms"], "rate": "1gbit"}]
    c = wan.parse_wan(lst)[(1, 2)]
    assert c[0].delay == pytest.approx(7 * MS) and c[1].delay == pytest.approx(5 * MS)
    # the resolved JSON (base units) reads back to the same cables
    r = wan.resolve(a, 10**9)
    assert wan.resolve(wan.parse_wan(wan.to_json(r)), None) == r
    assert wan.resolve(wan.parse_wan({(0, 1): {"delay": 0.04, "rate": 2e8}}), None)[(0, 1)][0].rate == 200_000_000


@pytest.mark.parametrize("spec, match", [
    ("0-1 40", "neither a delay"),
    ("0-1 40ms 30ms", "delay is given twice"),
    ("0-1 40ms, 1-0 5ms", "given twice"),
    ("0-0 4ms", "two different nodes"),
    ("a-b 4ms", "not a cable"),
    ("0-1 20s", "out of range"),
    ("0-1 4ms loss=100%", "out of range"),
    ("0-1 4ms queue=10", "smaller than one packet"),
    ("0-1 4ms 1/2/3", "neither"),
    ("0-1 4ms jitter=1ms", "unknown setting"),
    ("0-1 4ms 10bit", "below 100kbit"),
])
def test_errors_say_what_is_wrong(spec, match):
    with pytest.raises(wan.WanSpecError, match=match):
        wan.parse_wan(spec)


def test_testbed_takes_the_spec():
    tb = Testbed(3, wan="0-1 20ms 200mbit, 1-2 5ms/6ms", link_rate="1gbit")
    assert sorted(tb.wan) == [(0, 1), (1, 2)]
    assert tb.wan_directions(2, 1)[0].delay == pytest.approx(6 * MS) and tb.wan_directions(0, 2) is None
    d = tb.describe()
    cables = {c["peer"]: c for c in d["node_list"][1]["cables"]}
    assert cables[0]["iface"] == "mesh0" and cables[0]["wan"]["delay"] == pytest.approx(20 * MS)
    assert cables[2]["wan"]["rate"] == 10**9 and "wan" not in d["node_list"][0]["cables"][1]
    assert wan.describe_cable(*tb.wan[(1, 2)]) == "5ms 1gbit / 6ms 1gbit"
    with pytest.raises(TestbedError, match="no cable between nodes 0 and 2"):
        Testbed(3, links=[(0, 1), (1, 2)], wan="0-2 5ms")
    with pytest.raises(TestbedError, match="nodes are 0..2"):
        Testbed(3, wan="0-3 5ms")
    with pytest.raises(TestbedError, match="neither a delay"):
        Testbed(3, wan="0-1 fast")
    # buffers: 4x the largest bandwidth-delay product + queue, at least 16 MiB
    assert wan.tcp_buffer_max(tb.wan, 6 << 20) == 16 << 20
    big = wan.resolve(wan.parse_wan("0-1 50ms 1gbit"), None)
    assert wan.tcp_buffer_max(big, 0) == 4 * 2 * int(1e9 / 8 * 0.1)
