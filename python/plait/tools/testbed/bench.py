"""The mesh benchmark: allreduce on a testbed of N nodes with a cable per pair and a slower LAN,
plait against the full-mesh bound 2S/(N B), the cables' TCP floor, gloo with default settings, and
gloo with the best manual workaround. Everything is measured in the same run, on the same testbed.

The TCP floor is what the machine's kernel can move over the cables: every node sends 2S/N bytes
to every other node over one plain TCP stream per cable, all at once (what a direct allreduce
moves, without reductions, copies or steps). On a small machine the floor, not the cables' rate,
can be the limit: 4 nodes are 12 busy cable directions, each packet crossing veth and tbf in
softirq on the same few cores. "x floor" says how close plait comes to what is possible there.

    sudo python -m plait.tools.testbed.bench                       # N = 3 and 4, 64 MiB, 1gbit cables, 100mbit LAN
    sudo python -m plait.tools.testbed.bench --nodes 3 --mib 16 --json bench.json
    sudo python -m plait.tools.testbed.bench --line                # 3 nodes in a line: the ends relayed

The gloo workaround (what a careful user would set up by hand): every node gets a /32 "node"
address on its loopback (10.200.0.<i+1>), a static host route to every other node's address over
the cable to that node (`ip route add 10.200.0.2/32 via 10.1.2.2 dev mesh1 src 10.200.0.1`), its
hostname resolves to its node address (/etc/hosts), and MASTER_ADDR is node 0's node address. gloo
binds to whatever the hostname resolves to, so its full mesh of pair connections then runs over
the cables. (GLOO_SOCKET_IFNAME=lo would pick 127.0.0.1, which peers cannot reach.) gloo's ring
still uses one cable per direction of each node.

Times are the slowest rank's median of `--iters` allreduces after a warm-up (gloo over the LAN:
one allreduce, no warm-up: one round takes ~7 s at 100 Mbit/s).
"""

import argparse
import json
import statistics
import sys
import time

from .._jsonout import add_json_option, to_stdout, write_json
from .._ui import Console, Table
from . import Testbed, TestbedError, check_can_build, format_rate, node_addr, parse_rate

_NOISE = ("hostname of the client socket cannot be retrieved",)


def measure(tb, lib, *, nbytes, iters, warmup, timeout, env=None, console=None, op="allreduce", to=1):
    """Runs the allreduce worker on every node; returns {"t", "ok", "err", "algo", "topology",
    "routes", "times", "ring_order", "links", "predicted_s", "schedule"} with t = the slowest rank's
    median time in seconds (the rest as rank 0 of plait saw them: the cost model's prediction for
    the schedule it ran)."""
    cmd = [sys.executable, "-m", "plait.tools.testbed._worker", "--lib", lib, "--bytes", str(nbytes), "--iters",
           str(iters), "--warmup", str(warmup), "--timeout", str(timeout), "--op", op, "--to", str(to)]
    res = tb.run(cmd, timeout=timeout + 30, env=env, stream=False, grace=5.0)
    per_rank, errs = [], []
    for r in range(tb.n):
        ev = None
        for line in res.lines[r]:
            if line.startswith("@@"):
                try:
                    ev = json.loads(line[2:])
                except ValueError:
                    pass
        if ev is None:
            tail = [x for x in res.lines[r] if not any(s in x for s in _NOISE)][-5:]
            errs.append(f"rank {r}: exit {res.returncodes[r]}" + (" (timed out)" if res.timed_out else "")
                        + (": " + " | ".join(tail) if tail else ""))
            continue
        if ev.get("err"):
            errs.append(f"rank {r}: {ev['err']}")
        per_rank.append(ev)
    ok = not errs and len(per_rank) == tb.n and all(e["ok"] for e in per_rank)
    t = max(statistics.median(e["times"]) for e in per_rank) if per_rank and all(e["times"] for e in per_rank) else None
    first = per_rank[0] if per_rank else {}
    return {"lib": lib, "t": t, "ok": ok, "err": "; ".join(errs) or None, "algo": first.get("algo"),
            "topology": first.get("topology"), "routes": {e["rank"]: e.get("routes") for e in per_rank},
            "times": {e["rank"]: e["times"] for e in per_rank}, "ring_order": first.get("ring_order"),
            "links": first.get("links"), "predicted_s": first.get("predicted_s"), "schedule": first.get("schedule")}


def bench_world(n, *, link_rate, lan_rate, nbytes, iters, timeout, gloo_default=True, gloo_workaround=True,
                name="plaitbench", console=None, log=print):
    """All measurements on one n-node testbed. Returns a dict (JSON-able)."""
    link_bps, lan_bps = parse_rate(link_rate), parse_rate(lan_rate)
    out = {"nodes": n, "bytes": nbytes, "link_rate_bps": link_bps, "lan_rate_bps": lan_bps, "runs": []}
    if link_bps:
        b = link_bps / 8
        out["bound_full_mesh_s"] = 2 * nbytes / (n * b)
        out["bound_ring_over_cables_s"] = 2 * (n - 1) / n * nbytes / b
    if lan_bps:
        out["bound_lan_s"] = 2 * (n - 1) / n * nbytes / (lan_bps / 8)
    with Testbed(n, link_rate=link_rate, lan_rate=lan_rate, name=name, node_addrs=True) as tb:
        log(f"N={n}: TCP floor, a plain stream per cable ({iters} x 2S/N each way) ...")
        out["runs"].append(dict(measure(tb, "tcp", nbytes=nbytes, iters=iters, warmup=1, timeout=timeout),
                                config="TCP floor: a plain stream per cable, 2S/N each way"))
        log(f"N={n}: plait ({iters} x {nbytes / 2**20:g} MiB) ...")
        out["runs"].append(dict(measure(tb, "plait", nbytes=nbytes, iters=iters, warmup=1, timeout=timeout),
                                config="plait, zero configuration"))
        if gloo_default:
            log(f"N={n}: gloo, default settings (hostname -> LAN address) ...")
            out["runs"].append(dict(measure(tb, "gloo", nbytes=nbytes, iters=1, warmup=0, timeout=timeout),
                                    config="gloo, default (LAN)"))
        if gloo_workaround:
            log(f"N={n}: gloo with node addresses and host routes over the cables ...")
            tb.resolve_hostnames("node")
            try:
                out["runs"].append(dict(measure(tb, "gloo", nbytes=nbytes, iters=max(2, iters // 2), warmup=1,
                                                timeout=timeout, env={"MASTER_ADDR": node_addr(0)}),
                                        config="gloo, workaround: node addrs + host routes"))
            finally:
                tb.resolve_hostnames("lan")
    return out


LINE_RUNS = (("p2p", 1, {"PLAIT_IFACE": "mesh"}, "plait send/recv 0 -> 1, its cable"),
             ("p2p", 2, {"PLAIT_IFACE": "mesh"}, "plait send/recv 0 -> 2, relayed through 1 (cables only)"),
             ("p2p", 2, {}, "plait send/recv 0 -> 2 over the LAN (the default: 0 and 2 share the LAN)"),
             ("allreduce", 1, {"PLAIT_IFACE": "mesh"}, "plait allreduce, cables only (0-2 relayed)"),
             ("allreduce", 1, {}, "plait allreduce, default (0-2 over the LAN)"))


def bench_line(*, link_rate, lan_rate, nbytes, iters, timeout, gloo=True, name="plaitbench", log=print):
    """Three nodes in a line (cables 0-1 and 1-2, a LAN for all): ranks 0 and 2 share no cable, so
    either they talk over the LAN or, with the LAN excluded (PLAIT_IFACE=mesh), rank 1 relays."""
    out = {"nodes": 3, "bytes": nbytes, "link_rate_bps": parse_rate(link_rate), "lan_rate_bps": parse_rate(lan_rate),
           "runs": []}
    with Testbed(3, link_rate=link_rate, lan_rate=lan_rate, links=[(0, 1), (1, 2)], name=name) as tb:
        for op, to, env, config in LINE_RUNS:
            log(f"{config} ({iters} x {nbytes / 2**20:g} MiB) ...")
            r = measure(tb, "plait", nbytes=nbytes, iters=iters, warmup=1, timeout=timeout, env=env, op=op, to=to)
            out["runs"].append(dict(r, config=config, op=op))
        if gloo:
            log(f"gloo allreduce, default (over the LAN) (1 x {nbytes / 2**20:g} MiB) ...")
            r = measure(tb, "gloo", nbytes=nbytes, iters=1, warmup=0, timeout=timeout)
            out["runs"].append(dict(r, config="gloo allreduce, default (over the LAN)", op="allreduce"))
    return out


def report_line(res, console):
    nbytes, cable = res["bytes"], res["link_rate_bps"]
    t = Table(title=f"{nbytes / 2**20:g} MiB on 3 nodes in a line ({format_rate(cable)} cables 0-1 and 1-2, "
                    f"{format_rate(res['lan_rate_bps'])} LAN), slowest rank's median")
    for c in ("configuration", "time", "Mbit/s", "of the cable rate"):
        t.add_column(c, justify="left" if c == "configuration" else "right")
    for r in res["runs"]:
        if not r["ok"] or not r["t"]:
            t.add_row(r["config"], "[red]FAILED", "", "")
            continue
        # send/recv: bytes moved per second; allreduce: bus bandwidth, 2 (N - 1) / N of the bytes.
        bps = nbytes * 8 / r["t"] * (1 if r["op"] == "p2p" else 4 / 3)
        t.add_row(r["config"], f"{r['t'] * 1e3:.0f} ms", f"{bps / 1e6:.0f}", f"{bps / cable:.2f}" if cable else "")
    console.print(t)
    for r in res["runs"]:
        if r["err"]:
            console.print(f"[red]{r['config']}: {r['err']}", highlight=False)


def report(results, console):
    t = Table(title="allreduce, float32, on the mesh testbed (slowest rank's median)")
    for c in ("N", "size", "configuration", "time", "busbw Gbit/s", "x bound 2S/(NB)", "x floor", "plait faster by"):
        t.add_column(c, justify="left" if c == "configuration" else "right")
    for w in results:
        n, nbytes = w["nodes"], w["bytes"]
        bound = w.get("bound_full_mesh_s")
        plait_t = next((r["t"] for r in w["runs"] if r["lib"] == "plait" and r["ok"]), None)
        floor_t = next((r["t"] for r in w["runs"] if r["lib"] == "tcp" and r["ok"]), None)
        for r in w["runs"]:
            if r["t"] is None or not r["ok"]:
                t.add_row(str(n), f"{nbytes / 2**20:g} MiB", r["config"], "[red]FAILED", "", "", "", "")
                continue
            busbw = nbytes / r["t"] * 2 * (n - 1) / n * 8 / 1e9
            ratio = f"{r['t'] / bound:.2f}" if bound else "-"
            of_floor = f"{r['t'] / floor_t:.2f}" if floor_t else "-"
            faster = f"{r['t'] / plait_t:.2f} x" if plait_t and r["lib"] == "gloo" else ""
            label = r["config"] + (f" [dim]({r['algo']} on {r['topology']})" if r["lib"] == "plait" else "")
            t.add_row(str(n), f"{nbytes / 2**20:g} MiB", label, f"{r['t'] * 1e3:.0f} ms", f"{busbw:.2f}", ratio,
                      of_floor, faster)
        if bound:
            t.add_row(str(n), "", "[dim]bound 2S/(N B) over the cables", f"[dim]{bound * 1e3:.0f} ms", "", "[dim]1.00",
                      "", "")
        t.add_section()
    console.print(t)
    for w in results:
        for r in w["runs"]:
            if r["err"]:
                console.print(f"[red]N={w['nodes']} {r['config']}: {r['err']}", highlight=False)
    w0 = results[0] if results else None
    if w0:
        console.print(f"cables {format_rate(w0['link_rate_bps'])} each, LAN {format_rate(w0['lan_rate_bps'])} "
                      "(tc tbf, both directions); B in the bound is the configured cable rate, so TCP/IP header "
                      "overhead (~5%) is inside the ratio. The TCP floor moves the same bytes per cable over plain "
                      "streams, all cables at once: what this machine's kernel can do.", highlight=False)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m plait.tools.testbed.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[3, 4])
    p.add_argument("--link-rate", default="1gbit")
    p.add_argument("--lan-rate", default="100mbit")
    p.add_argument("--mib", type=float, default=64, help="allreduce size in MiB (default 64)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout", type=float, default=180, help="seconds per measurement")
    p.add_argument("--no-gloo-default", action="store_true", help="skip gloo over the LAN (the slowest part)")
    p.add_argument("--no-gloo", action="store_true", help="plait only")
    add_json_option(p)
    p.add_argument("--name", default="plaitbench")
    p.add_argument("--line", action="store_true",
                   help="instead: 3 nodes in a line (no cable between 0 and 2): send/recv and allreduce with rank 1 "
                        "relaying the ends' frames, against the LAN and gloo")
    args = p.parse_args(argv)
    console = Console(width=max(130, Console().width), stderr=to_stdout(args.json))
    why = check_can_build()
    if why:
        console.print(f"[red]cannot run the mesh benchmark: {why}")
        return 2
    if not args.no_gloo:
        try:
            import torch.distributed  # noqa: F401
        except ImportError:
            console.print("[red]the gloo comparison needs torch: pip install 'plait[torch]' (or pass --no-gloo)")
            return 2
    nbytes = int(args.mib * 2**20) // 4 * 4
    results = []
    t0 = time.monotonic()
    if args.line:
        try:
            res = bench_line(link_rate=args.link_rate, lan_rate=args.lan_rate, nbytes=nbytes, iters=args.iters,
                             timeout=args.timeout, gloo=not args.no_gloo, name=args.name,
                             log=lambda m: console.print(f"[dim]{m}", highlight=False))
        except TestbedError as e:
            console.print(f"[red]{e}")
            return 2
        if not to_stdout(args.json):
            report_line(res, console)
        if args.json:
            write_json(args.json, {"command": sys.argv, "result": res})
        return 0 if all(r["ok"] for r in res["runs"]) else 1
    try:
        for n in args.nodes:
            results.append(bench_world(n, link_rate=args.link_rate, lan_rate=args.lan_rate, nbytes=nbytes,
                                       iters=args.iters, timeout=args.timeout, name=args.name,
                                       gloo_default=not (args.no_gloo or args.no_gloo_default),
                                       gloo_workaround=not args.no_gloo,
                                       log=lambda m: console.print(f"[dim]{m}", highlight=False)))
    except TestbedError as e:
        console.print(f"[red]{e}")
        return 2
    if not to_stdout(args.json):
        report(results, console)
    console.print(f"[dim]{time.monotonic() - t0:.0f} s in all; command: python -m plait.tools.testbed.bench "
                  + " ".join(argv if argv is not None else sys.argv[1:]), highlight=False)
    if args.json:
        write_json(args.json, {"command": sys.argv, "results": results})
    return 0 if all(r["ok"] for w in results for r in w["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
