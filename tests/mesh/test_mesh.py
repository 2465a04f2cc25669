"""plait on a real mesh of network namespaces: a cable (its own /24) per pair plus a shared LAN
that MASTER_ADDR is on. Each test builds its testbed, runs worlds in it, and removes it."""

import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from plait.tools.testbed import LAN_IFACE, Testbed, cable_addr, cable_iface, lan_addr

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "mesh_worker.py")
sys.path.insert(0, str(HERE.parent))
from harness import note  # noqa: E402

_names = iter(f"pltest{i}" for i in range(1000))


def bed(n, **kw):
    kw.setdefault("link_rate", None)  # unlimited: the tests are about correctness and routes
    kw.setdefault("lan_rate", None)
    return Testbed(n, name=next(_names), **kw)


def events(res, rank, ev=None):
    out = []
    for line in res.lines[rank]:
        if line.startswith("@@"):
            e = json.loads(line[2:])
            if ev is None or e.get("ev") == ev:
                out.append(e)
    return out


def one(res, rank, ev):
    e = events(res, rank, ev)
    assert e, f"rank {rank} printed no {ev!r} event; output:\n" + res.output(rank)[-3000:]
    return e[-1]


def run(tb, scenario, args=None, env=None, timeout=90):
    return tb.run([sys.executable, WORKER, scenario, json.dumps(args or {})], timeout=timeout, env=env,
                  stream=False, grace=15)


def assert_ok(res):
    assert res.ok, f"world failed: {res}\n" + "\n".join(f"--- rank {r}:\n" + res.output(r)[-2000:]
                                                        for r in range(len(res.lines)))


def routes_of(res, rank):
    return {r["peer"]: r for r in one(res, rank, "comm")["routes"]}


def assert_cables(tb, res):
    for i in range(tb.n):
        rts = routes_of(res, i)
        for j in range(tb.n):
            if j == i:
                continue
            rt = rts[j]
            assert rt["local_iface"] == cable_iface(i, j), f"rank {i} -> {j}: {rt}"
            assert rt["local"] == cable_addr(i, j) and rt["remote"] == cable_addr(j, i), f"rank {i} -> {j}: {rt}"


@pytest.mark.parametrize("n", [3, 4])
def test_collectives_and_routes_on_full_mesh(n):
    """Every collective is correct across namespaces, every pair uses its own cable although
    MASTER_ADDR is on the LAN, and the ranks agree the topology is a full mesh."""
    t0 = time.monotonic()
    with bed(n) as tb:
        assert tb.master_addr == lan_addr(0)
        res = run(tb, "collectives")
        assert_ok(res)
        for r in range(n):
            assert one(res, r, "result")["nfails"] == 0, one(res, r, "result")["fails"]
            assert one(res, r, "comm")["topology"] == "full_mesh"
        assert_cables(tb, res)
    note(f"mesh: every collective on a {n}-node full mesh: ok in {time.monotonic() - t0:.1f} s")


def test_iface_filter_and_route_file():
    """PLAIT_IFACE exclusion and CIDR force the LAN; a route file wins over subnet matching."""
    with bed(3) as tb:
        for spec in ("^mesh", "10.99.0.0/24", "=lan0"):
            res = run(tb, "routes", env={"PLAIT_IFACE": spec})
            assert_ok(res)
            for i in range(3):
                for j, rt in routes_of(res, i).items():
                    assert rt["local_iface"] == LAN_IFACE and rt["remote"] == lan_addr(j), f"{spec}: {i}->{j} {rt}"
                assert one(res, i, "comm")["topology"] == "shared", spec
        # Exclusion of one cable's subnet only: that pair falls back to the LAN, the rest keep cables.
        res = run(tb, "routes", env={"PLAIT_IFACE": "^10.1.2.0/24"})
        assert_ok(res)
        assert routes_of(res, 1)[0]["local_iface"] == LAN_IFACE
        assert routes_of(res, 2)[0]["local_iface"] == cable_iface(2, 0)
        assert routes_of(res, 2)[1]["local_iface"] == cable_iface(2, 1)

        # Route file: 0 <-> 1 over the LAN (by address and by name), the rest by cable names.
        path = Path(f"/tmp/{tb.name}-routes.json")
        matrix = [[None, lan_addr(0), cable_iface(0, 2)],
                  [LAN_IFACE, None, cable_addr(1, 2)],
                  [cable_iface(2, 0), cable_iface(2, 1), None]]
        path.write_text(json.dumps(matrix))
        try:
            res = run(tb, "routes", env={"PLAIT_ROUTES": str(path)})
            assert_ok(res)
            assert routes_of(res, 1)[0]["local"] == lan_addr(1) and routes_of(res, 1)[0]["remote"] == lan_addr(0)
            assert routes_of(res, 0)[1]["local_iface"] == LAN_IFACE
            assert routes_of(res, 2)[0]["local"] == cable_addr(2, 0)
            assert routes_of(res, 2)[1]["local"] == cable_addr(2, 1)
            assert "route file" in routes_of(res, 1)[0]["reason"]
            # A route file naming an interface a rank does not have is a clear error on that rank.
            matrix[2][0] = "nosuch0"
            path.write_text(json.dumps(matrix))
            res = run(tb, "routes", {"timeout": 5}, env={"PLAIT_ROUTES": str(path)}, timeout=60)
            err = one(res, 2, "comm_error")["err"]
            assert "nosuch0" in err and "rank 2" in err, err
        finally:
            path.unlink()


def test_cable_down_mid_allreduce_fails_every_rank_naming_the_peer():
    """One cable taken down from the root namespace during a stream of allreduces: every rank
    gets an error within the op timeout (no hang), and the ranks on the cable name each other."""
    op_timeout = 4.0
    with bed(3, link_rate="1gbit") as tb:
        procs = []
        argv = [sys.executable, WORKER, "cable_down", json.dumps({"op_timeout": op_timeout, "count": 4 * 2**20})]
        from plait.tools.testbed import free_port
        from plait.tools.testbed.run import stop_all

        port = free_port()
        outs = [[] for _ in range(3)]
        try:
            import subprocess

            for r in range(3):
                procs.append(tb.popen(r, argv, env=tb.env(r, port), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
            readers = []
            for r, p in enumerate(procs):
                t = threading.Thread(target=lambda r=r, p=p: outs[r].extend(
                    line.decode(errors="replace").rstrip() for line in iter(p.stdout.readline, b"")), daemon=True)
                t.start()
                readers.append(t)
            deadline = time.monotonic() + 60
            while sum(any('"ready"' in x for x in o) for o in outs) < 3:
                assert time.monotonic() < deadline, f"ranks not ready: {outs}"
                assert all(p.poll() is None for p in procs), f"a rank exited early: {outs}"
                time.sleep(0.05)
            time.sleep(0.3)  # well inside the next allreduces
            t_down = time.time()
            tb.set_cable(0, 1, up=False)
            for p in procs:
                p.wait(timeout=op_timeout * 3 + 10)
            for t in readers:
                t.join(5)
        finally:
            stop_all(procs)
        results = {}
        for r in range(3):
            ev = [json.loads(x[2:]) for x in outs[r] if x.startswith("@@") and '"result"' in x]
            assert ev, f"rank {r} reported nothing:\n" + "\n".join(outs[r][-20:])
            results[r] = ev[-1]
        for r, e in results.items():
            assert e["err"], f"rank {r} saw no error: {e}"
            after = e["at"] - t_down
            assert after <= op_timeout + 3.0, f"rank {r} failed {after:.1f} s after the cable went down: {e['err']}"
            note(f"mesh: cable 0-1 down: rank {r} failed {after:.2f} s later: {e['err'][:160]}")
        assert re.search(r"rank 1\b", results[0]["err"]), results[0]["err"]
        assert re.search(r"rank 0\b", results[1]["err"]), results[1]["err"]
        assert re.search(r"rank [01]\b", results[2]["err"]), results[2]["err"]


def test_doctor_on_mesh_warns_and_exits_nonzero_for_unreachable_peer():
    """`plait doctor --json` on a triangle with an MTU mismatch and a cable down before start:
    warnings for both; with the LAN excluded too, the peer is unreachable: non-zero exit naming it."""
    with bed(3, link_rate="1gbit", lan_rate="100mbit", mtu_ends={(0, 2): 9000}) as tb:
        tb.set_cable(1, 2, up=False)
        cmd = [sys.executable, "-m", "plait.tools.cli", "doctor", "--json", "--timeout", "8", "--budget", "0.1"]
        res = tb.run(cmd, timeout=60, stream=False)
        assert res.returncodes[0] == 0, res.output(0)[-3000:]
        rep = json.loads("\n".join(x for x in res.lines[0] if not x.startswith("[W")))
        codes = {w["code"] for w in rep["warnings"]}
        assert "mtu_mismatch" in codes and "lan_fallback" in codes, rep["warnings"]
        fb = next(w for w in rep["warnings"] if w["code"] == "lan_fallback")
        assert fb["ranks"] == [1, 2], fb
        assert rep["bandwidth_alone_gbps"][0][1] and rep["rtt_us"][0][2]
        assert "slow_link" in codes, rep["warnings"]  # the pair on the LAN (100mbit) vs the 1gbit cables
        # Cables only, one of them down: rank 1 and rank 2 cannot reach each other, and rank 0,
        # which reaches both, relays their frames; the doctor says so.
        res = tb.run(cmd, timeout=60, stream=False, env={"PLAIT_IFACE": "mesh"})
        assert res.returncodes[0] == 0, res.output(0)[-3000:]
        rep = json.loads("\n".join(x for x in res.lines[0] if not x.startswith("[W")))
        relayed = [w for w in rep["warnings"] if w["code"] == "relayed_pair"]
        assert len(relayed) == 1 and relayed[0]["ranks"] == [0, 1, 2], rep["warnings"]
        assert "ranks 1 and 2 cannot connect to each other" in relayed[0]["message"], relayed
        assert "through rank 0" in relayed[0]["message"], relayed
        # Without relays, start-up fails naming the pair.
        res = tb.run(cmd, timeout=60, stream=False, env={"PLAIT_IFACE": "mesh", "PLAIT_RELAY": "0"})
        assert res.returncodes[0] == 1, res.output(0)[-3000:]
        rep = json.loads("\n".join(x for x in res.lines[0] if not x.startswith("[W")))
        errs = [w for w in rep["warnings"] if w["level"] == "error"]
        culprit = [w for w in errs if w["code"] == "unreachable_peer"]
        assert culprit and culprit[0]["ranks"] == [1, 2], errs
        assert re.search(r"rank 2 cannot reach rank 1|rank 1 cannot reach rank 2", culprit[0]["message"]), culprit


def test_a_pair_without_a_cable_goes_through_the_rank_between_them():
    """A line of three nodes (cables 0-1 and 1-2, the LAN excluded): ranks 0 and 2 have no route
    to each other, so rank 1 passes their frames on; every collective (send/recv around the ring
    too) is right, and both ends name the relay."""
    t0 = time.monotonic()
    with bed(3, links=[(0, 1), (1, 2)]) as tb:
        res = run(tb, "collectives", env={"PLAIT_IFACE": "mesh"})
        assert_ok(res)
        for r in range(3):
            assert one(res, r, "result")["nfails"] == 0, one(res, r, "result")["fails"]
            assert one(res, r, "comm")["topology"] == "partial_mesh"
        for i, j in ((0, 2), (2, 0)):
            rt = routes_of(res, i)[j]
            assert rt["via"] == 1, rt
            assert "relayed through rank 1" in rt["reason"] and "could not connect to rank 0" in rt["reason"], rt
        assert routes_of(res, 0)[1]["via"] is None and routes_of(res, 1)[2]["local_iface"] == cable_iface(1, 2)
    note(f"mesh: every collective on a 3-node line, 0-2 relayed through 1: ok in {time.monotonic() - t0:.1f} s")


def test_testbed_cli_up_run_down():
    """The command line: up prints the addresses, run sets the torchrun variables and returns the
    failing rank's status, --timeout kills every rank (124), down removes everything."""
    import subprocess

    name = next(_names)
    cli = [sys.executable, "-m", "plait.tools.cli", "testbed"]

    def sh(*args, timeout=60):
        return subprocess.run(cli + list(args), capture_output=True, text=True, timeout=timeout)

    try:
        p = sh("up", "--nodes", "2", "--name", name, "--link-rate", "none", "--lan-rate", "none")
        assert p.returncode == 0, p.stderr
        assert "10.1.2.1" in p.stderr and "10.99.0.2" in p.stderr, p.stderr
        p = sh("up", "--nodes", "2", "--name", name)
        assert p.returncode == 2 and "already up" in p.stderr, p.stderr
        p = sh("run", "--name", name, "--", "sh", "-c",
               'echo "$RANK/$WORLD_SIZE $MASTER_ADDR $(hostname)"; exit $((RANK * 3))')
        assert p.returncode == 3, (p.stdout, p.stderr)
        assert f"[0] 0/2 10.99.0.1 {name}-0" in p.stdout and f"[1] 1/2 10.99.0.1 {name}-1" in p.stdout, p.stdout
        t0 = time.monotonic()
        p = sh("run", "--name", name, "--timeout", "2", "--", "sleep", "30")
        assert p.returncode == 124 and time.monotonic() - t0 < 15, (p.returncode, p.stdout, p.stderr)
    finally:
        p = sh("down", "--name", name)
    assert p.returncode == 0 and f"{name}-0" in p.stderr, p.stderr
    p = sh("run", "--name", name, "--", "true")
    assert p.returncode == 2 and "no testbed named" in p.stderr, p.stderr
