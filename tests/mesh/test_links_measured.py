"""Links measured at start-up (PLAIT_MEASURE): on four hosts whose cable between nodes 1 and 2 is
slow, every rank measures that cable's rate near its spec and the others far above it, every rank
ends with the same matrix and the same ring order, that order leaves the slow cable out, and a ring
allreduce in it computes the right sum."""

import json
import sys

import harness
import pytest
from plait.tools.testbed import Testbed


def _results(res, n):
    out = []
    for r in range(n):
        ev = next((json.loads(x[2:]) for x in res.lines[r] if x.startswith("@@")), None)
        assert ev is not None and ev["ok"], f"rank {r}: {res.lines[r][-5:]}"
        out.append(ev)
    return out


def test_the_ring_leaves_out_a_slow_cable_that_every_rank_measured_alike():
    slow_bps = 50e6
    with Testbed(4, name="pltestlinks", link_rate="1gbit", lan_rate=None, wan="1-2 1ms 50mbit") as tb:
        cmd = [sys.executable, "-m", "plait.tools.testbed._worker", "--lib", "plait", "--bytes", str(4 << 20),
               "--iters", "2", "--warmup", "0", "--timeout", "60"]
        res = tb.run(cmd, timeout=120, env={"PLAIT_ALGO": "allreduce:ring"}, stream=False)
    ranks = _results(res, 4)
    first = ranks[0]
    assert all(r["links"] == first["links"] for r in ranks), "every rank has the same matrix"
    assert all(r["ring_order"] == first["ring_order"] for r in ranks), [r["ring_order"] for r in ranks]
    bw = first["links"]["bytes_per_s"]
    for a, b in ((1, 2), (2, 1)):
        assert 0.5 * slow_bps <= bw[a][b] * 8 <= 1.1 * slow_bps, f"{a}->{b}: {bw[a][b] * 8e-6:.1f} Mbit/s"
    others = [bw[i][j] for i in range(4) for j in range(4) if i != j and {i, j} != {1, 2}]
    assert min(others) * 8 > 3 * slow_bps, [round(v * 8e-6) for v in others]
    harness.note(f"links measured on 4 hosts, cable 1-2 at 50 Mbit/s: 1->2 {bw[1][2] * 8e-6:.1f}, 2->1 "
                 f"{bw[2][1] * 8e-6:.1f} Mbit/s, the others {min(others) * 8e-6:.0f}-{max(others) * 8e-6:.0f}; "
                 f"ring order {first['ring_order']}")
    order = first["ring_order"]
    edges = {frozenset((order[p], order[(p + 1) % 4])) for p in range(4)}
    assert frozenset((1, 2)) not in edges, order
    assert order[0] == 0 and sorted(order) == [0, 1, 2, 3]


def test_the_wan_benchmark_runs_and_reports_every_configuration(tmp_path):
    from plait.tools.testbed import wanbench

    out = tmp_path / "wan.json"
    spec = "0-1 2ms 200mbit, 1-2 2ms 20mbit, 2-3 2ms 200mbit, 0-3 2ms 200mbit, 0-2 2ms 200mbit, 1-3 2ms 200mbit"
    rc = wanbench.main(["--mib", "1", "--iters", "1", "--no-gloo", "--wan", spec, "--name", "pltestwanb",
                        "--json", str(out)])
    res = json.loads(out.read_text())["result"]
    assert rc == 0, res
    configs = [r["config"] for r in res["runs"]]
    assert configs == ["plait, default (links measured)", "plait, ring in the measured order",
                       "plait, ring in rank order"], configs
    assert all(r["ok"] and r["t"] > 0 and r["predicted_s"] > 0 for r in res["runs"]), res["runs"]
    assert res["runs"][2]["schedule"] == "ring" and res["runs"][1]["schedule"].startswith("ring (order ")
    order = res["ring_order"]
    assert frozenset((1, 2)) not in {frozenset((order[p], order[(p + 1) % 4])) for p in range(4)}, order


def _transfer(tb, op, env):
    cmd = [sys.executable, "-m", "plait.tools.testbed._worker", "--lib", "plait", "--op", op, "--bytes",
           str(32 << 20), "--iters", "1", "--warmup", "0", "--timeout", "60"]
    return _results(tb.run(cmd, timeout=120, env=dict(env, PLAIT_MEASURE="1"), stream=False), 2)


def test_a_link_one_stream_cannot_fill_gets_more_streams():
    """A 80 ms round trip, 1 Gbit/s cable between hosts with a stock Linux kernel's TCP buffer
    limits (4 MiB to send): one stream keeps at most those buffers in flight, about 250 Mbit/s
    over 80 ms. Start-up sees the stream held back by its buffers, opens more connections
    (PLAIT_STREAMS_MAX), measures again over them, both ends hold the same matrix, and a broadcast
    and a message in pieces spread over them arrive whole. (How much faster they are is the WAN
    benchmark's business: the testbed's delay line shares this machine's 2 cores with 8
    connections' threads, and short transfers over fresh connections vary a lot.) Start-up decides
    from what it measured; a run whose short trains happened to read the link low adds none, so
    the grown world gets three tries."""
    with Testbed(2, name="pltestlanes", lan_rate=None, wan="0-1 40ms 1gbit", tcp_buffers="stock") as tb:
        one = _transfer(tb, "broadcast", {"PLAIT_STREAMS_MAX": "1"})
        for _ in range(3):
            grown = _transfer(tb, "broadcast", {})
            if grown[0]["streams"] > 1:
                break
        p2p = _transfer(tb, "p2p", {"PLAIT_STREAMS": "2", "PLAIT_STREAMS_MAX": "1"})
    assert [r["streams"] for r in one] == [1, 1], "PLAIT_STREAMS_MAX=1 adds no connection"
    streams = [r["streams"] for r in grown]
    assert streams[0] == streams[1] and streams[0] > 1, streams
    assert grown[0]["links"] == grown[1]["links"], "both ends hold the same matrix"
    assert [r["streams"] for r in p2p] == [2, 2]
    rate = lambda res: [res[0]["links"]["bytes_per_s"][0][1] * 8e-6, res[0]["links"]["bytes_per_s"][1][0] * 8e-6]  # noqa: E731
    harness.note(f"cable 40 ms each way, 1 Gbit/s, stock TCP buffers: one stream measured "
                 f"{'/'.join(f'{v:.0f}' for v in rate(one))} Mbit/s, {streams[0]} streams "
                 f"{'/'.join(f'{v:.0f}' for v in rate(grown))}; broadcast of 32 MiB {one[1]['times'][0] * 1e3:.0f} ms "
                 f"-> {grown[1]['times'][0] * 1e3:.0f} ms; a 32 MiB message in pieces over 2 streams "
                 f"{p2p[1]['times'][0] * 1e3:.0f} ms")


def test_the_mesh_benchmark_measures_the_tcp_floor_next_to_plait(tmp_path):
    """The mesh benchmark's floor moves 2S/N bytes each way over every cable, on plain streams;
    its times are real (a slower cable makes it slower), and plait's row is priced against it."""
    from plait.tools.testbed import bench

    out = tmp_path / "mesh.json"
    rc = bench.main(["--nodes", "3", "--mib", "2", "--iters", "2", "--no-gloo", "--link-rate", "200mbit",
                     "--name", "pltestmeshb", "--json", str(out)])
    (world,) = json.loads(out.read_text())["results"]
    assert rc == 0, world
    floor, plait = world["runs"]
    assert [floor["lib"], plait["lib"]] == ["tcp", "plait"], world["runs"]
    assert floor["ok"] and plait["ok"], world["runs"]
    # 2 MiB on 3 nodes: 1.33 MiB each way per 200 Mbit/s cable, at least 56 ms on the wire.
    wire = 2 * (2 << 20) / 3 / (200e6 / 8)
    assert floor["t"] >= 0.95 * wire, (floor["t"], wire)
    assert world["bound_full_mesh_s"] == pytest.approx(wire)
    harness.note(f"mesh bench, 3 nodes, 2 MiB, 200 Mbit/s cables: TCP floor {floor['t'] * 1e3:.0f} ms, plait "
                 f"{plait['t'] * 1e3:.0f} ms, bound {wire * 1e3:.0f} ms")
