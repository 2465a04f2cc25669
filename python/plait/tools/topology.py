"""`plait topology`: the links as plait measures them at start-up, the ring order it derives, and
what its cost model predicts for each algorithm of a collective (allreduce, or broadcast or
reduce from a root: `--coll`, `--root`); with `--bench`, each prediction next to the measured
time; with `--fit`, the cost model's constants fitted to those times.

Run once per rank like the job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): under torchrun,
`plait testbed run -- plait topology`, or `plait topology --local 3` for ranks on this machine.
Every rank measures (PLAIT_MEASURE=1 unless set otherwise), rank 0 reports.
"""

import argparse
import math
import os
import statistics
import sys
import time

from ._jsonout import add_json_option, to_stdout, write_json

DEFAULT_SIZES = "4K,1M,16M,64M"


def parse_size(text):
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def _show_size(n):
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


COLLECTIVES = ("allreduce", "broadcast", "reduce")


def measure_world(comm, sizes, bench, iters, coll="allreduce", root=0):
    """Rank 0's report: matrix, ring order, and per (size, algorithm) of `coll` the prediction
    and, with `bench`, the slowest rank's median time. Every rank must call it (the benchmark is
    collective)."""
    import numpy as np

    import plait

    algos = plait._core.algorithms(coll)
    root = root if coll != "allreduce" else 0
    rows = []
    for nbytes in sizes:
        chosen = comm.algorithm_for(coll, nbytes, root)
        x = np.ones(max(1, nbytes // 4), np.float32)
        out = np.empty_like(x)

        def run(algo):
            if coll == "allreduce":
                comm.allreduce(x, out=out, algo=algo)
            elif coll == "broadcast":
                comm.broadcast(x, root, algo=algo)
            else:
                comm.reduce(x, root, out=out if comm.rank == root else None, algo=algo)

        for algo in algos:
            predicted, schedule = comm.predict(coll, nbytes, root, algo=algo)
            row = {"bytes": nbytes, "algorithm": algo, "schedule": schedule, "predicted_s": predicted,
                   "chosen": algo == chosen, "measured_s": None}
            if bench:
                run(algo)  # warm-up
                times = []
                for _ in range(iters):
                    comm.barrier()
                    t0 = time.perf_counter()
                    run(algo)
                    times.append(time.perf_counter() - t0)
                mine = np.array([statistics.median(times)], np.float64)
                row["measured_s"] = float(comm.allreduce(mine, op="max")[0])
            rows.append(row)
    return {"world_size": comm.world_size, "collective": coll, "root": root, "topology": comm.topology(), "links": comm.link_matrix(),
            "ring_order": comm.ring_order(), "rows": rows, "cost_model": os.environ.get("PLAIT_COST_MODEL") or None,
            "error_factor": error_factor((r["predicted_s"], r["measured_s"]) for r in rows) if bench else None}


def links_table(links, title):
    """The link matrix (`Communicator.link_matrix()`) as a table: Mbit/s (one-way latency ms),
    from row to column."""
    from ._ui import Table

    n = len(links["bytes_per_s"])
    t = Table(title=title, title_justify="left")
    t.add_column("from \\ to", justify="right")
    for j in range(n):
        t.add_column(str(j), justify="right")
    for i in range(n):
        t.add_row(str(i), *("" if i == j else f"{(links['bytes_per_s'][i][j] or 0) * 8e-6:.0f} "
                            f"({(links['latency_s'][i][j] or 0) * 1e3:.2f})" for j in range(n)))
    return t


def print_report(rep, console=None):
    from ._ui import Console, Table

    console = console or Console(width=max(120, Console().width))
    n = rep["world_size"]
    links = rep["links"]
    console.print(f"[bold]plait topology[/]: {n} ranks, {rep['topology']}; ring order "
                  f"[bold]{' > '.join(map(str, rep['ring_order']))}[/] (then back to {rep['ring_order'][0]})",
                  highlight=False)
    if links is None:
        console.print("[yellow]the links were not measured (PLAIT_MEASURE=0?)")
    else:
        console.print(links_table(links, "links measured at start-up: Mbit/s (one-way latency ms), from row to column"))
    bench = any(r["measured_s"] is not None for r in rep["rows"])
    coll = rep.get("collective", "allreduce") + (f" from rank {rep['root']}" if rep.get("collective", "allreduce") != "allreduce" else "")
    t = Table(title=f"{coll}, float32: the cost model's prediction" + (" and the slowest rank's median" if bench else ""),
              title_justify="left")
    for c in ("size", "algorithm", "schedule", "predicted") + (("measured", "measured / predicted") if bench else ()):
        t.add_column(c, justify="left" if c in ("algorithm", "schedule") else "right")
    last = None
    for r in rep["rows"]:
        if last is not None and r["bytes"] != last:
            t.add_section()
        last = r["bytes"]
        name = f"[bold]{r['algorithm']}[/] (chosen)" if r["chosen"] else r["algorithm"]
        cells = [_show_size(r["bytes"]), name, r["schedule"], _ms(r["predicted_s"])]
        if bench:
            m = r["measured_s"]
            cells += [_ms(m), f"{m / r['predicted_s']:.2f}" if m and r["predicted_s"] else ""]
        t.add_row(*cells)
    console.print(t)
    if rep.get("error_factor"):
        console.print(f"typical error factor of the predictions: {rep['error_factor']:.2f} (constants: "
                      f"{rep.get('cost_model') or 'the defaults'})", highlight=False)
    fit = rep.get("fit")
    if fit:
        t = Table(title="measured / predicted, with the constants in use and with the fitted ones", title_justify="left")
        for c in ("size", "algorithm", "measured", "in use", "fitted"):
            t.add_column(c, justify="left" if c == "algorithm" else "right")
        for r in rep["rows"]:
            if r.get("fitted_s"):
                m = r["measured_s"]
                t.add_row(_show_size(r["bytes"]), r["algorithm"], _ms(m), f"{m / r['predicted_s']:.2f}", f"{m / r['fitted_s']:.2f}")
        console.print(t)
        console.print(f"typical error factor {fit['error_before']:.2f} with the constants in use, "
                      f"{fit['error_after']:.2f} fitted: alpha {fit['alpha'] * 1e6:.1f} us, bandwidth "
                      f"{fit['bandwidth'] * 8e-9:.2f} Gbit/s, gamma {fit['gamma'] * 1e9:.2f} ns per byte, "
                      f"parallelism {fit['parallelism']:.2f}", highlight=False)
        console.print(f"to use them, set on every rank: [bold]PLAIT_COST_MODEL={fit['setting']}[/]", highlight=False)


def _ms(s):
    if s is None:
        return ""
    return f"{s * 1e3:.3f} ms" if s < 0.01 else f"{s * 1e3:.1f} ms"


def plot(rep, path):
    """The ranks on a circle, an arrow per directed link (width by its rate), the ring in bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, links, order = rep["world_size"], rep["links"], rep["ring_order"]
    pos = [(math.cos(2 * math.pi * i / n + math.pi / 2), math.sin(2 * math.pi * i / n + math.pi / 2)) for i in range(n)]
    fig, ax = plt.subplots(figsize=(6, 6))
    ring = {(order[p], order[(p + 1) % n]) for p in range(n)}
    top = max((links["bytes_per_s"][i][j] for i in range(n) for j in range(n) if i != j), default=1) if links else 1
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            (x0, y0), (x1, y1) = pos[i], pos[j]
            # the two directions of a pair side by side: shift each to its left
            dx, dy = x1 - x0, y1 - y0
            norm = math.hypot(dx, dy) or 1
            ox, oy = -dy / norm * 0.04, dx / norm * 0.04
            bw = links["bytes_per_s"][i][j] if links else top
            on_ring = (i, j) in ring
            ax.annotate("", xy=(x1 * 0.88 + ox, y1 * 0.88 + oy), xytext=(x0 * 0.88 + ox, y0 * 0.88 + oy),
                        arrowprops=dict(arrowstyle="-|>", lw=0.5 + 4.5 * bw / top,
                                        color="tab:red" if on_ring else "0.6", alpha=0.9 if on_ring else 0.6))
            if links:  # near the sender, so that crossing diagonals keep their labels apart
                lx, ly = x0 + 0.3 * dx, y0 + 0.3 * dy
                ax.text(lx * 0.88 + 2.5 * ox, ly * 0.88 + 2.5 * oy, f"{bw * 8e-6:.0f}",
                        fontsize=7, ha="center", va="center", color="tab:red" if on_ring else "0.3")
    for i, (x, y) in enumerate(pos):
        ax.add_patch(plt.Circle((x, y), 0.09, color="tab:blue", zorder=3))
        ax.text(x, y, str(i), color="white", ha="center", va="center", fontsize=12, zorder=4, weight="bold")
    ax.set_xlim(-1.3, 1.3)
    ax.set_ylim(-1.3, 1.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"links in Mbit/s; the ring {' > '.join(map(str, order))} in red", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def error_factor(pairs):
    """exp of the root mean squared log of predicted / measured over `pairs`: 1.3 means the
    predictions are typically 30 % off, either way. None without pairs."""
    logs = [math.log(p / m) ** 2 for p, m in pairs if p and m]
    return math.exp(math.sqrt(sum(logs) / len(logs))) if logs else None


def fit_report(comm, rows, coll="allreduce", root=0):
    """The cost model's constants fitted to the measured rows (rank 0 alone may call it): the
    `PLAIT_COST_MODEL` text, the constants, each row's prediction after the fit, and the typical
    error factor (exp of the root mean squared log error) before and after."""
    runs = [(coll, r["algorithm"], r["bytes"], root, r["measured_s"]) for r in rows if r["measured_s"]]
    fit = comm.fit_cost_model(runs)
    measured = [r[4] for r in runs]
    fit["error_before"], fit["error_after"] = error_factor(zip(fit["before"], measured)), error_factor(zip(fit["after"], measured))
    after = iter(fit["after"])
    for r in rows:
        if r["measured_s"]:
            r["fitted_s"] = next(after)
    return fit


def run_rank(rank, n, master_addr, port, *, sizes, bench, iters, timeout, json_path=None, plot_path=None, fit=False,
             coll="allreduce", root=0):
    import plait
    from .doctor import open_rank_store

    os.environ.setdefault("PLAIT_MEASURE", "1")
    # A malformed setting fails every rank at once, before any waits on the store (rank 0 serves
    # it: a rank 0 that failed first would leave the others retrying until the timeout).
    plait._core.env_config()
    store = open_rank_store(rank, n, master_addr, port, timeout)
    comm = plait.Communicator(store, rank, n, timeout=timeout)
    try:
        rep = measure_world(comm, sizes, bench or fit, iters, coll, root)
        if fit and rank == 0:
            rep["fit"] = fit_report(comm, rep["rows"], coll, rep["root"])
        comm.barrier()
    finally:
        comm.close()
        if rank == 0:
            time.sleep(0.3)  # rank 0 serves the store
    if rank != 0:
        return 0
    if plot_path:
        try:
            plot(rep, plot_path)
        except ImportError:
            print("plait topology: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    if json_path:
        write_json(json_path, rep)
    if not to_stdout(json_path):
        print_report(rep)
    return 0


def add_arguments(p):
    p.add_argument("--local", type=int, metavar="N", help="start N ranks on this machine (loopback) instead of "
                   "reading RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--coll", choices=COLLECTIVES, default="allreduce", help="the collective whose algorithms are "
                   "predicted (and timed) (default allreduce)")
    p.add_argument("--root", type=int, default=0, help="root rank of a broadcast or reduce (default 0)")
    p.add_argument("--bench", action="store_true", help="also run every algorithm at every size and show the "
                   "measured time next to the prediction")
    p.add_argument("--fit", action="store_true", help="run every algorithm at every size (as --bench), fit the cost "
                   "model's constants (alpha, bandwidth, gamma, parallelism) to the times, and print the PLAIT_COST_MODEL setting "
                   "that uses them")
    p.add_argument("--iters", type=int, default=5, help="timed calls per algorithm and size with --bench (default 5)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the ranks, the measured links and the ring (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for start-up and every operation (default 120)")
    add_json_option(p, help="write the report as JSON to PATH (rank 0); `--json -` (or --json alone) prints it on "
                    "stdout instead of the tables")


def main(args):
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        print(f"plait topology: --sizes {args.sizes!r}: sizes such as 4K,1M,64M", file=sys.stderr)
        return 2
    if not sizes or any(s < 4 for s in sizes) or args.iters < 1:
        print("plait topology: sizes must be at least 4 bytes and --iters at least 1", file=sys.stderr)
        return 2
    if args.local is not None:
        from .doctor import run_local_command

        if args.local < 2:
            print("plait topology: --local needs at least 2 ranks", file=sys.stderr)
            return 2
        rest = ["--sizes", args.sizes, "--iters", str(args.iters), "--timeout", str(args.timeout),
                "--coll", args.coll, "--root", str(args.root)] \
            + (["--bench"] if args.bench else []) + (["--fit"] if args.fit else []) \
            + (["--json", args.json] if args.json else []) \
            + (["--plot", args.plot] if args.plot else [])
        return run_local_command("topology", args.local, rest, args.timeout * 3 + 30)
    from .doctor import run_as_job_rank

    return run_as_job_rank("topology", lambda rank, n, master_addr, port: run_rank(
        rank, n, master_addr, port, sizes=sizes, bench=args.bench, iters=args.iters, timeout=args.timeout,
        json_path=args.json, plot_path=args.plot, fit=args.fit, coll=args.coll, root=args.root))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="plait topology", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
