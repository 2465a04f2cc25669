"""`plait demo`, second act: a short DDP training on local ranks, with plait and with gloo.

Both runs train the same small model on the same batches; the act prints the two loss curves side
by side (they agree to float rounding: only the order of the gradient sums may differ) and the
step times. Run alone with `python -m plait.tools.demo_ddp [--nproc 3] [--steps 30]`.

`python -m plait.tools.demo_ddp --wire bf16` instead trains with plait twice, float32 on the wire and
then compressed (bf16, f16 or int8), and compares the losses: compression rounds every gradient
sum, so the curves are not identical, but they must end at the same loss within noise.

The ranks are `python -m plait.tools.demo_ddp --worker` processes meeting through torchrun's
environment variables (rank 0 serves the TCPStore); they write JSON lines to stdout.
"""

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from statistics import median
from ._local import free_port as _free_port, kill_group, popen_kwargs, read_json_lines as _read

LIMIT = 180.0  # seconds before a run's ranks are given up on


# ----------------------------------------------------------------------------------------------
# worker side


def _emit(**event):
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    if a.backend == "plait":
        import plait.torch  # noqa: F401

    import datetime

    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    d_in, hidden, d_out = 32, 256, 8
    model = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                          nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, d_out))
    ddp = DDP(model, bucket_cap_mb=0.1)  # several buckets: communication overlaps backward
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    w_true = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(7))
    per_rank = a.batch // world
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(per_rank * world, d_in, generator=g)
        y = torch.tanh(x @ w_true) + 0.05 * torch.randn(per_rank * world, d_out, generator=g)
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(xs), ys)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        times = torch.tensor([dt])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
        if rank == 0:
            _emit(kind="step", step=step, loss=avg.item() / world, ms=times.item() * 1000)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    _emit(kind="done", rank=rank, checksum=float(flat.double().sum()), params=[float(v) for v in flat[:64]])
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# parent side


def _run_backend(backend, nproc, steps, batch, on_step, wire=None):
    """Runs one training; returns (steps, done records, error text or None)."""
    port = _free_port()
    logs = [tempfile.TemporaryFile() for _ in range(nproc)]
    procs = []
    events = queue.Queue()
    steps_seen, done = [], {}
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("PLAIT_WIRE_DTYPE", None)
    if wire:
        env["PLAIT_WIRE_DTYPE"] = wire
    try:
        for r in range(nproc):
            cmd = [sys.executable, "-m", "plait.tools.demo_ddp", "--worker", "--backend", backend,
                   "--steps", str(steps), "--batch", str(batch)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logs[r], **popen_kwargs(),
                                          env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
        readers = [threading.Thread(target=_read, args=(r, p.stdout, events), daemon=True) for r, p in enumerate(procs)]
        for t in readers:
            t.start()
        open_streams = nproc
        deadline = time.monotonic() + LIMIT
        while open_streams and time.monotonic() < deadline:
            try:
                rank, ev = events.get(timeout=0.5)
            except queue.Empty:
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                continue
            if ev is None:
                open_streams -= 1
            elif ev["kind"] == "step":
                steps_seen.append(ev)
                on_step(ev)
            elif ev["kind"] == "done":
                done[ev["rank"]] = ev
        timed_out = open_streams > 0 and time.monotonic() >= deadline
    finally:
        for p in procs:
            kill_group(p)
        for p in procs:
            p.wait()
    error = None
    bad = [r for r, p in enumerate(procs) if p.returncode != 0 or r not in done]
    if bad:
        r = bad[0]
        logs[r].seek(0)
        tail = logs[r].read().decode(errors="replace").strip().splitlines()[-12:]
        error = (f"{backend}: rank {r} exited with status {procs[r].returncode}"
                 + (" (killed after the time limit)" if timed_out else "") + "\n" + "\n".join(tail))
    return steps_seen, done, error


def run_ddp_act(console, nproc=3, steps=30, batch=96):
    """The DDP act of `plait demo`. Returns a summary dict (`ok` is True when both runs finished
    and their losses agree)."""
    from ._ui import Table

    try:
        import torch  # noqa: F401
    except ImportError:
        console.print("[dim]DDP act skipped: torch is not installed (pip install 'plait[torch]')", highlight=False)
        return {"ok": True, "skipped": "no torch"}
    console.rule(f"[bold]DDP training: {nproc} local ranks, plait and gloo")
    console.print(f"A {steps}-step DistributedDataParallel run of a small MLP (several gradient buckets), "
                  "once per backend; same model, same batches.", highlight=False)
    results = {}
    for backend in ("plait", "gloo"):
        with console.status(f"training with {backend} ...") as status:
            def on_step(ev, status=status, backend=backend):
                status.update(f"training with {backend}: step {ev['step'] + 1}/{steps}, loss {ev['loss']:.5f}")

            t0 = time.monotonic()
            results[backend] = _run_backend(backend, nproc, steps, batch, on_step) + (time.monotonic() - t0,)
        s, done, err, wall = results[backend]
        if err:
            console.print(f"[red]{err}", highlight=False, markup=False)
    (ps, pdone, perr, pwall), (gs, gdone, gerr, gwall) = results["plait"], results["gloo"]
    summary = {"nproc": nproc, "steps": steps, "plait": ps, "gloo": gs}
    if perr or not ps:
        summary["ok"] = False
        return summary
    table = Table(title="loss per step (mean over ranks) and step time (slowest rank)")
    table.add_column("step", justify="right")
    table.add_column("plait loss", justify="right")
    table.add_column("gloo loss", justify="right")
    table.add_column("", justify="center")
    table.add_column("plait ms", justify="right")
    table.add_column("gloo ms", justify="right")
    worst = 0.0
    gby = {e["step"]: e for e in gs}
    show = set(range(min(5, len(ps)))) | set(range(max(0, len(ps) - 3), len(ps))) | set(range(0, len(ps), max(1, len(ps) // 8)))
    for e in ps:
        g = gby.get(e["step"])
        rel = abs(e["loss"] - g["loss"]) / max(abs(g["loss"]), 1e-12) if g else None
        if rel is not None:
            worst = max(worst, rel)
        if e["step"] not in show:
            continue
        same = "[green]=" if rel is not None and rel < 1e-5 else ("[red]!=" if rel is not None else "")
        table.add_row(str(e["step"]), f"{e['loss']:.6f}", f"{g['loss']:.6f}" if g else "-", same,
                      f"{e['ms']:.1f}", f"{g['ms']:.1f}" if g else "-")
    console.print(table)
    pm = median(e["ms"] for e in ps[1:] or ps)
    line = f"median step: plait {pm:.1f} ms"
    if gs:
        gm = median(e["ms"] for e in gs[1:] or gs)
        line += f", gloo {gm:.1f} ms ({gm / pm:.2f}x)"
        summary.update(plait_ms=pm, gloo_ms=gm)
    console.print(line + f"; whole run incl. start-up: plait {pwall:.1f} s, gloo {gwall:.1f} s", highlight=False)
    # every plait rank ends with the same parameters; and the same as gloo's, to float rounding
    sums = [pdone[r]["checksum"] for r in sorted(pdone)]
    ranks_agree = all(pdone[r]["params"] == pdone[0]["params"] for r in pdone)
    agree = worst < 1e-5
    if gdone:
        pdiff = max(abs(a - b) for a, b in zip(pdone[0]["params"], gdone[0]["params"]))
        summary["param_max_diff_vs_gloo"] = pdiff
        console.print(f"losses: plait and gloo agree to {worst:.1e} (relative); final parameters differ by at most "
                      f"{pdiff:.1e}; every plait rank holds identical parameters: {ranks_agree}", highlight=False)
    else:
        console.print(f"[yellow]gloo run failed; plait ranks hold identical parameters: {ranks_agree}")
    summary.update(loss_rel_diff=worst, ranks_agree=ranks_agree, checksums=sums, ok=bool(agree and ranks_agree and not perr))
    console.print("[bold green]DDP act: plait trains like gloo" if summary["ok"] else "[bold red]DDP act: mismatch")
    return summary


def run_wire_check(console, wire, nproc=3, steps=60, batch=96, tail=10):
    """Trains with plait twice, float32 wire then `wire`, and compares the losses. Returns a
    summary dict; `ok` when both runs learn (the loss at least halves) and the mean loss of the
    last `tail` steps agrees within 2 %."""
    from ._ui import Table

    runs = {}
    for w in ("native", wire):
        with console.status(f"training with plait, {w} wire ...") as status:
            def on_step(ev, status=status, w=w):
                status.update(f"plait, {w} wire: step {ev['step'] + 1}/{steps}, loss {ev['loss']:.5f}")

            s, done, err = _run_backend("plait", nproc, steps, batch, on_step, wire=w)
        if err or len(s) < steps:
            console.print(f"[red]{w} wire run failed: {err}", highlight=False, markup=False)
            return {"ok": False, "wire": wire, "error": err}
        runs[w] = [e["loss"] for e in sorted(s, key=lambda e: e["step"])]
    base, comp = runs["native"], runs[wire]
    table = Table(title=f"DDP loss per step, plait with float32 wire and {wire} wire ({nproc} ranks)")
    for col in ("step", "float32 wire", f"{wire} wire", "relative difference"):
        table.add_column(col, justify="right")
    for i in sorted(set(range(0, steps, max(1, steps // 10))) | {steps - 1}):
        table.add_row(str(i), f"{base[i]:.6f}", f"{comp[i]:.6f}", f"{abs(comp[i] - base[i]) / base[i]:.1e}")
    console.print(table)
    end_base, end_comp = sum(base[-tail:]) / tail, sum(comp[-tail:]) / tail
    tolerance = 0.02
    rel = abs(end_comp - end_base) / end_base
    ok = rel <= tolerance and end_base < 0.5 * base[0] and end_comp < 0.5 * comp[0]
    console.print(f"mean loss of the last {tail} steps: float32 wire {end_base:.6f}, {wire} wire {end_comp:.6f} "
                  f"(relative difference {rel:.2%}, tolerance {tolerance:.0%}; from {base[0]:.4f} at step 0)", highlight=False)
    console.print(f"[bold green]{wire} wire trains to the same loss" if ok else f"[bold red]{wire} wire: loss differs")
    return {"ok": ok, "wire": wire, "end_native": end_base, "end_wire": end_comp, "rel_diff": rel, "tolerance": tolerance,
            "native": base, "compressed": comp}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--wire", choices=("bf16", "f16", "int8"), default=None,
                    help="compare plait with float32 and with this wire dtype instead of plait with gloo")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="plait", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    from ._ui import Console

    if a.wire:
        s = run_wire_check(Console(), a.wire, nproc=a.nproc, steps=a.steps, batch=a.batch)
        return 0 if s.get("ok") else 1

    s = run_ddp_act(Console(), nproc=a.nproc, steps=a.steps, batch=a.batch)
    return 0 if s.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
