"""The WAN benchmark: allreduce between sites joined by WAN cables of unequal rates and delays
(one slow cable among fast ones), plait with its measured links against the rank-order ring and
gloo, all in the same run on the same testbed.

    sudo python -m plait.tools.testbed.wanbench                    # 4 sites, 64 MiB, the default cables
    sudo python -m plait.tools.testbed.wanbench --mib 16 --wan "0-1 10ms 1gbit, ..." --json wan.json
    sudo python -m plait.tools.testbed.wanbench --pipe              # 256 MiB over one 100 ms, 1 Gbit/s cable

Runs, each the slowest rank's median of `--iters` allreduces after one warm-up:
- plait as it starts by default: it measures every directed link at start-up (`PLAIT_MEASURE`,
  on because the sites are different hosts), orders its rings by the matrix and picks the
  algorithm by its cost model over the measured links;
- plait forced to `ring`, in the measured order;
- plait forced to `ring` in rank order (`PLAIT_RING_ORDER=rank`): what a ring that does not look
  at the links does;
- gloo over the WAN cables (node addresses and host routes, as in the mesh benchmark; gloo's
  default would take the testbed's LAN, which is not part of the WAN).
"""

import argparse
import sys
import time

from .._jsonout import add_json_option, to_stdout, write_json
from .._ui import Console, Table
from . import Testbed, TestbedError, check_can_build, node_addr
from . import wan as _wan
from .bench import measure

# One long fat pipe: 100 ms round trip at 1 Gbit/s (a bandwidth-delay product of 12.5 MB).
PIPE_WAN = "0-1 50ms 1gbit"

# Four sites; the cable between 1 and 2 is slow, and it lies on the rank-order ring 0-1-2-3-0.
DEFAULT_WAN = "0-1 10ms 500mbit, 1-2 25ms 50mbit, 2-3 10ms 500mbit, 0-3 15ms 500mbit, 0-2 20ms 500mbit, 1-3 20ms 500mbit"


def bench_wan(spec, *, nodes, nbytes, iters, timeout, gloo=True, name="plaitwan", log=print):
    _wan.parse_wan(spec)  # a bad spec fails before anything is built
    out = {"nodes": nodes, "bytes": nbytes, "wan": spec, "runs": []}
    with Testbed(nodes, wan=spec, name=name, node_addrs=True) as tb:
        def run(config, env=None, lib="plait", n_iters=iters):
            log(f"{config} ({n_iters} x {nbytes / 2**20:g} MiB) ...")
            r = dict(measure(tb, lib, nbytes=nbytes, iters=n_iters, warmup=1, timeout=timeout, env=env), config=config)
            out["runs"].append(r)
            return r

        first = run("plait, default (links measured)")
        out["ring_order"] = first.get("ring_order")
        out["links"] = first.get("links")
        run("plait, ring in the measured order", {"PLAIT_ALGO": "allreduce:ring"})
        run("plait, ring in rank order", {"PLAIT_ALGO": "allreduce:ring", "PLAIT_RING_ORDER": "rank"})
        if gloo:
            tb.resolve_hostnames("node")
            try:
                run("gloo over the WAN cables", {"MASTER_ADDR": node_addr(0)}, lib="gloo", n_iters=max(1, iters // 2))
            finally:
                tb.resolve_hostnames("lan")
    return out


PIPE_RUNS = (("p2p", {"PLAIT_STREAMS_MAX": "1"}, "send/recv, one stream (PLAIT_STREAMS_MAX=1)"),
             ("p2p", {}, "send/recv, streams as start-up chose"),
             ("broadcast", {"PLAIT_STREAMS_MAX": "1"}, "broadcast, one stream (PLAIT_STREAMS_MAX=1)"),
             ("broadcast", {}, "broadcast, streams as start-up chose"))


def bench_pipe(spec, *, nbytes, iters, timeout, name="plaitwan", log=print, tcp_buffers="fit"):
    """Rank 0 sends nbytes to rank 1 over one WAN cable: one message (send/recv) and a broadcast
    (pipelined in segments, spread over every connection), each with one TCP stream and with the
    streams start-up opens on its own (PLAIT_STREAMS_MAX)."""
    out = {"nodes": 2, "bytes": nbytes, "wan": spec, "runs": [], "tcp_buffers": tcp_buffers}
    (a, b), (there, back) = next(iter(_wan.parse_wan(spec).items()))
    out["rate_bits_per_s"] = there.rate
    with Testbed(2, wan=spec, name=name, tcp_buffers=tcp_buffers) as tb:
        for op, env, config in PIPE_RUNS:
            log(f"plait {config} ({iters} x {nbytes / 2**20:g} MiB) ...")
            r = measure(tb, "plait", nbytes=nbytes, iters=iters, warmup=1, timeout=timeout, op=op,
                        env=dict(env, PLAIT_MEASURE="1"))
            streams = [x.get("streams") for x in (r["routes"].get(1) or [])]
            out["runs"].append(dict(r, config=f"plait {config}", op=op, streams=streams[0] if streams else None))
    return out


def report_pipe(res, console):
    rate = res["rate_bits_per_s"]
    possible = _wan.goodput(rate) if rate else None
    buffers = "TCP buffers fitted to the cable" if res.get("tcp_buffers", "fit") == "fit" else "stock TCP buffers"
    t = Table(title=f"one transfer of {res['bytes'] / 2**20:g} MiB over one WAN cable ({res['wan']}, {buffers}), "
                    "receiver's median")
    for c in ("configuration", "streams", "time", "Mbit/s", "of the cable's TCP goodput"):
        t.add_column(c, justify="left" if c == "configuration" else "right")
    for r in res["runs"]:
        if not r["ok"] or not r["t"]:
            t.add_row(r["config"], "", "[red]FAILED", "", "")
            continue
        bps = res["bytes"] * 8 / r["t"]
        t.add_row(r["config"], str(r.get("streams") or ""), f"{r['t'] * 1e3:.0f} ms", f"{bps / 1e6:.0f}",
                  f"{bps / possible:.2f}" if possible else "")
    console.print(t)
    for r in res["runs"]:
        if r["err"]:
            console.print(f"[red]{r['config']}: {r['err']}", highlight=False)


def report(res, console):
    runs = res["runs"]
    n, nbytes = res["nodes"], res["bytes"]
    t_of = {r["config"]: r["t"] for r in runs if r["ok"] and r["t"]}
    rank_ring = t_of.get("plait, ring in rank order")
    gloo_t = t_of.get("gloo over the WAN cables")
    t = Table(title=f"allreduce, float32, {nbytes / 2**20:g} MiB, {n} sites over WAN cables (slowest rank's median)")
    for c in ("configuration", "algorithm", "time", "predicted", "busbw Mbit/s", "vs rank-order ring", "vs gloo"):
        t.add_column(c, justify="left" if c in ("configuration", "algorithm") else "right")
    for r in runs:
        if not r["ok"] or not r["t"]:
            t.add_row(r["config"], "", "[red]FAILED", "", "", "", "")
            continue
        busbw = nbytes / r["t"] * 2 * (n - 1) / n * 8 / 1e6
        vs_ring = f"{rank_ring / r['t']:.2f} x" if rank_ring else ""
        vs_gloo = f"{gloo_t / r['t']:.2f} x" if gloo_t else ""
        algo = r.get("schedule") or r.get("algo") or ""
        predicted = f"{r['predicted_s'] * 1e3:.0f} ms" if r.get("predicted_s") else ""
        t.add_row(r["config"], algo, f"{r['t'] * 1e3:.0f} ms", predicted, f"{busbw:.0f}", vs_ring, vs_gloo)
    console.print(t)
    links = res.get("links")
    if links:
        m = Table(title="links as plait measured them at start-up: Mbit/s (one-way latency ms), from row to column")
        m.add_column("from \\ to", justify="right")
        for j in range(n):
            m.add_column(str(j), justify="right")
        for i in range(n):
            cells = []
            for j in range(n):
                bw, lat = links["bytes_per_s"][i][j], links["latency_s"][i][j]
                cells.append("" if i == j else f"{bw * 8e-6:.0f} ({lat * 1e3:.1f})")
            m.add_row(str(i), *cells)
        console.print(m)
    console.print(f"cables: {res['wan']}", highlight=False)
    for r in runs:
        if r["err"]:
            console.print(f"[red]{r['config']}: {r['err']}", highlight=False)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m plait.tools.testbed.wanbench", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--wan", default=DEFAULT_WAN, help=f"the cables (testbed --wan syntax); default: {DEFAULT_WAN}")
    p.add_argument("--mib", type=float, default=64, help="allreduce size in MiB (default 64)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300, help="seconds per measurement")
    p.add_argument("--no-gloo", action="store_true", help="plait only")
    p.add_argument("--name", default="plaitwan")
    p.add_argument("--pipe", action="store_true",
                   help=f"instead: one transfer (default 256 MiB) over one long fat cable ({PIPE_WAN} unless --wan "
                        "names another), as one message and as a broadcast, with one TCP stream and with the "
                        "streams start-up opens on its own")
    p.add_argument("--stock-buffers", action="store_true",
                   help="give the nodes a stock Linux kernel's TCP buffer limits (tcp_rmem max 6 MiB, tcp_wmem "
                        "max 4 MiB) instead of limits fitted to the cables")
    add_json_option(p)
    args = p.parse_args(argv)
    if args.pipe:
        if args.wan == DEFAULT_WAN:
            args.wan = PIPE_WAN
        if args.mib == 64 and "--mib" not in (argv if argv is not None else sys.argv[1:]):
            args.mib = 256
    console = Console(width=max(130, Console().width), stderr=to_stdout(args.json))
    why = check_can_build()
    if why:
        console.print(f"[red]cannot run the WAN benchmark: {why}")
        return 2
    nbytes = int(args.mib * 2**20) // 4 * 4
    t0 = time.monotonic()
    log = lambda m: console.print(f"[dim]{m}", highlight=False)  # noqa: E731
    try:
        if args.pipe:
            res = bench_pipe(args.wan, nbytes=nbytes, iters=args.iters, timeout=args.timeout, name=args.name, log=log,
                             tcp_buffers="stock" if args.stock_buffers else "fit")
        else:
            res = bench_wan(args.wan, nodes=args.nodes, nbytes=nbytes, iters=args.iters, timeout=args.timeout,
                            gloo=not args.no_gloo, name=args.name, log=log)
    except TestbedError as e:
        console.print(f"[red]{e}")
        return 2
    if not to_stdout(args.json):
        (report_pipe if args.pipe else report)(res, console)
    console.print(f"[dim]{time.monotonic() - t0:.0f} s in all; command: python -m plait.tools.testbed.wanbench "
                  + " ".join(argv if argv is not None else sys.argv[1:]), highlight=False)
    if args.json:
        write_json(args.json, {"command": sys.argv, "result": res})
    return 0 if all(r["ok"] for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
