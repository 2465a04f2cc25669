"""`plait demo`: start a few local ranks on loopback, run every collective once with verification,
then an allreduce size sweep, and print what happened next to a raw TCP stream measured in the same
run. The ranks are `python -m plait.tools.demo --worker` processes (see _demo_worker.py)."""

import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from statistics import median

from .._store import tcp_store
from ._jsonout import to_stdout, write_json
from ._local import kill_group, popen_kwargs, read_json_lines as _read
from ._ui import BarColumn, Console, Progress, SpinnerColumn, Table, TextColumn, TimeElapsedColumn

LIMIT = 150.0  # seconds before the demo gives up on its ranks


def run(nproc=3, quick=False, json_path=None, console=None, mesh=True):
    """Runs the demo; returns the exit status (0 when every check passed). With `mesh` (the
    default), it then runs the mesh act when it can build the testbed (root, `ip netns`). With
    `json_path` "-" the summary goes to stdout as JSON instead of the tables, the rest to stderr."""
    console = console or Console(stderr=to_stdout(json_path))
    tables = Console(quiet=True) if to_stdout(json_path) else console
    try:
        import datetime

        import torch.distributed  # noqa: F401
    except ImportError:
        console.print("[red]plait demo uses torch's TCPStore for the ranks to meet: pip install 'plait[torch]'")
        return 2
    store = tcp_store("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    logs = [tempfile.TemporaryFile() for _ in range(nproc)]
    procs = []
    events = queue.Queue()
    try:
        for r in range(nproc):
            cmd = [sys.executable, "-m", "plait.tools.demo", "--worker", "--rank", str(r), "--nproc", str(nproc),
                   "--port", str(store.port)] + (["--quick"] if quick else [])
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logs[r], **popen_kwargs(),
                                          env=dict(os.environ, PYTHONUNBUFFERED="1")))
        readers = [threading.Thread(target=_read, args=(r, p.stdout, events), daemon=True)
                   for r, p in enumerate(procs)]
        for t in readers:
            t.start()
        results, timed_out = _follow(console, nproc, readers, events)
    finally:
        for p in procs:
            kill_group(p)
        for p in procs:
            p.wait()
    failed_ranks = [r for r, p in enumerate(procs) if p.returncode != 0 or not results["done"][r]]
    for i, r in enumerate(failed_ranks):
        logs[r].seek(0)
        tail = logs[r].read().decode(errors="replace").strip().splitlines()[-15 if i == 0 else -1:]
        console.print(f"[red]rank {r} exited with status {procs[r].returncode}"
                      + (" (killed after the time limit)" if timed_out else "") + ":")
        for line in tail:
            console.print(f"  {line}", markup=False, highlight=False)
    summary = _report(tables, nproc, results)
    if mesh:
        summary["mesh"] = mesh_act(console)
        summary["failed"] += bool(summary["mesh"] and summary["mesh"].get("failed"))
    if json_path:
        write_json(json_path, summary, indent=2)
    if failed_ranks:
        console.print(f"[bold red]{len(failed_ranks)} of {nproc} ranks failed")
    elif summary["failed"]:
        console.print(f"[bold red]{summary['failed']} check(s) failed")
    else:
        console.print("[bold green]all checks passed")
    return 1 if failed_ranks or summary["failed"] else 0


def mesh_act(console, nbytes=64 * 2**20, nodes=3):
    """A 3-node triangle of network namespaces (1 Gbit/s per cable, 100 Mbit/s LAN that MASTER_ADDR
    and every hostname are on): 64 MiB allreduce with plait and with torch's gloo (default settings),
    next to the full-mesh bound 2S/(N B). Returns a summary dict, or None when skipped."""
    from .testbed import Testbed, TestbedError, check_can_build

    why = check_can_build()
    if why:
        console.print(f"[dim]mesh act skipped: {why}", highlight=False)
        return None
    try:
        import torch.distributed  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    from .testbed.bench import measure

    link_bps = 1e9
    bound = 2 * nbytes / (nodes * link_bps / 8)
    out = {"nodes": nodes, "bytes": nbytes, "bound_s": bound, "failed": 0}
    try:
        with console.status(f"mesh act: {nodes} namespaces, a 1 Gbit/s cable per pair, a 100 Mbit/s LAN ..."):
            with Testbed(nodes, link_rate="1gbit", lan_rate="100mbit", name="plaitdemo") as tb:
                pl = measure(tb, "plait", nbytes=nbytes, iters=3, warmup=1, timeout=60)
                gl = (measure(tb, "gloo", nbytes=nbytes, iters=1, warmup=0, timeout=60) if have_torch else None)
    except TestbedError as e:
        console.print(f"[red]mesh act: {e}")
        out["failed"] = 1
        return out
    table = Table(title=f"Mesh act: allreduce of {nbytes // 2**20} MiB f32 on a {nodes}-node triangle "
                        "(1 Gbit/s cables, 100 Mbit/s LAN)")
    for col in ("library", "what it used", "time", "x bound", "check"):
        table.add_column(col, justify="right" if col in ("time", "x bound") else "left")
    for name, r in (("plait", pl), ("gloo", gl)):
        if r is None:
            continue
        if name == "plait":
            rts = (r.get("routes") or {}).get(0) or (r.get("routes") or {}).get("0") or []
            used = f"{r.get('algo')} on {r.get('topology')}: " + ", ".join(
                f"{x.get('local_iface')}->{x['peer']}" for x in rts) + " (rank 0)"
        else:
            used = "default settings: hostname -> LAN address"
        ok = r["ok"] and r["t"] is not None
        out["failed"] += not ok
        out[name] = {"t": r["t"], "ok": r["ok"], "err": r["err"]}
        table.add_row(name, used, _time(r["t"]) if r["t"] else "-", f"{r['t'] / bound:.2f}" if r["t"] else "-",
                      "[green]ok" if ok else f"[red]FAILED {str(r['err'])[:120]}")
    table.add_row("bound", "2S/(N B), every cable busy both ways", _time(bound), "1.00", "")
    console.print(table)
    if pl["t"] and gl and gl["t"]:
        console.print(f"plait {gl['t'] / pl['t']:.1f} x faster than gloo's default, which sends everything over "
                      "the LAN its hostname resolves to", highlight=False)
    elif not have_torch:
        console.print("[dim]gloo comparison skipped: torch is not installed", highlight=False)
    return out


def _follow(console, nproc, readers, events):
    results = {"coll": {}, "sweep": {}, "p2p": None, "raw": None, "done": [False] * nproc}
    open_streams = nproc
    deadline = time.monotonic() + LIMIT
    columns = (SpinnerColumn(), TextColumn("{task.description:<28}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"starting {nproc} ranks", total=None)
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                return results, True
            try:
                rank, ev = events.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if ev is None:
                open_streams -= 1
                continue
            kind = ev.get("ev")
            if kind == "progress":
                steps = progress.tasks[0].total
                progress.update(task, description=ev["label"], total=ev["total"],
                                completed=0 if steps is None else progress.tasks[0].completed + 1)
            elif kind == "coll":
                results["coll"].setdefault((ev["name"], ev["detail"]), {})[rank] = ev
            elif kind == "sweep":
                results["sweep"].setdefault(ev["bytes"], {})[rank] = ev
            elif kind in ("p2p", "raw") and ev.get("seconds"):
                results[kind] = ev
            elif kind == "done":
                results["done"][rank] = True
    return results, False


def _report(console, n, results):
    failed = 0
    out = {"nproc": n, "collectives": [], "sweep": [], "p2p": None, "raw_tcp": None}
    table = Table(title=f"Every collective once, {n} ranks on loopback, checked against numpy")
    for col in ("collective", "what", "result", "time (slowest rank)"):
        table.add_column(col, justify="right" if col.startswith("time") else "left")
    for (name, detail), per_rank in results["coll"].items():
        errs = [f"rank {r}: {e['err']}" for r, e in sorted(per_rank.items()) if not e["ok"]]
        ok = not errs and len(per_rank) == n
        failed += not ok
        ms = max(e["ms"] for e in per_rank.values())
        table.add_row(name, detail, "[green]ok" if ok else f"[red]FAILED {'; '.join(errs)[:200]}", f"{ms:.2f} ms")
        out["collectives"].append({"name": name, "detail": detail, "ok": ok, "ms": ms, "errors": errs})
    if table.row_count:
        console.print(table)

    table = Table(title=f"allreduce sweep: f32, {n} ranks, busbw = algbw x 2(n-1)/n")
    for col in ("size", "algorithm", "time p50", "algbw GB/s", "busbw GB/s", "check"):
        table.add_column(col, justify="left" if col in ("algorithm", "check") else "right")
    best = 0.0
    for nbytes, per_rank in sorted(results["sweep"].items()):
        t = max(median(e["times"]) for e in per_rank.values())  # the slowest rank's median
        algbw = nbytes / t / 1e9
        busbw = algbw * 2 * (n - 1) / n
        best = max(best, busbw)
        ok = all(e["ok"] for e in per_rank.values()) and len(per_rank) == n
        failed += not ok
        algo = per_rank[min(per_rank)]["algo"]
        table.add_row(_size(nbytes), algo, _time(t), f"{algbw:.2f}", f"{busbw:.2f}", "[green]ok" if ok else "[red]WRONG")
        out["sweep"].append({"bytes": nbytes, "algorithm": algo, "p50_s": t, "algbw_GBps": algbw,
                             "busbw_GBps": busbw, "ok": ok})
    if table.row_count:
        console.print(table)

    lines = []
    if results["p2p"]:
        e = results["p2p"]
        out["p2p"] = {"bytes": e["bytes"], "seconds": e["seconds"], "GBps": e["bytes"] / e["seconds"] / 1e9}
        lines.append(f"plait send/recv, {_size(e['bytes'])} rank 0 -> 1: {out['p2p']['GBps']:.2f} GB/s")
    if results["raw"]:
        e = results["raw"]
        raw = e["bytes"] / e["seconds"] / 1e9
        out["raw_tcp"] = {"bytes": e["bytes"], "seconds": e["seconds"], "GBps": raw}
        lines.append(f"raw single TCP stream on loopback (Python sockets, {_size(e['bytes'])}): {raw:.2f} GB/s")
        if best:
            lines.append(f"best allreduce busbw {best:.2f} GB/s = {best / raw:.2f} x the raw stream")
    else:
        failed += 1
        lines.append("[red]the raw TCP reference was not measured")
    if not results["coll"]:
        failed += 1
    for line in lines:
        console.print(line)
    out["failed"] = failed
    return out


def _size(nbytes):
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 1024} KiB"


def _time(t):
    return f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        from plait.tools._demo_worker import main

        sys.exit(main(sys.argv[1:]))
    sys.exit(run(quick="--quick" in sys.argv[1:]))
