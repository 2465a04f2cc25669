"""`plait bench`: an nccl-tests-shaped sweep through torch.distributed, one backend after another
in the same run (same world, same sizes, same machine), so the ratios mean something.

By default it spawns `--nproc` local ranks on loopback; under torchrun or `plait testbed run`
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) it measures the real links instead.

Metrics follow nccl-tests (GB = 1e9 bytes): each rank takes the median (p50) and the 99th
percentile (p99) of its own per-iteration times, and the slowest rank's figure is reported;
algbw = S / t(p50), busbw = algbw * factor, with S and factor per collective as in
`shared/notes/benchmarks.md`. "mean" is the loop's wall time divided by the iterations on the
slowest rank (nccl-tests' own time figure): it includes everything between calls, so it shows
throughput of back-to-back calls where p50 shows the latency of one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from .._store import tcp_store
from ._jsonout import add_json_option, to_stdout, write_json
from ._local import free_port as _free_port, kill_group, popen_kwargs

OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "sendrecv")
DTYPES = ("f32", "f64", "f16", "bf16", "i32", "i64", "u8")


def parse_size(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
    try:
        v = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 8, 64K, 128M)") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return v


def busbw_factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def sizes(begin: int, end: int, factor: float) -> list[int]:
    out, s = [], begin
    while s <= end:
        out.append(s)
        nxt = int(s * factor)
        s = nxt if nxt > s else s + 1
    return out


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="plait bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size S (default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20, help="largest size S (default 64M)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplier between steps (default 2)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="1: verify results after timing (default), 0: skip")
    p.add_argument("--op", choices=OPS, default="allreduce")
    p.add_argument("--dtype", choices=DTYPES, default="f32")
    p.add_argument("--wire", choices=("native", "bf16", "f16", "int8"), default=None,
                   help="plait wire compression for f32 allreduce (default: PLAIT_WIRE_DTYPE or none)")
    p.add_argument("--backend", default="plait",
                   help="comma list run one after another, e.g. plait,gloo; 'plait:ALGO' is plait with the "
                        "algorithm forced (a built-in's name or a custom schedule's, see --schedules); 'tcp-ring' "
                        "(allreduce only) is the floor: each rank streams the bytes a ring allreduce moves, "
                        "2(n-1)/n * S, to its neighbour over plain TCP while receiving as much, with no reduction "
                        "and no copies")
    p.add_argument("--async-op", choices=("wait", "future"), default=None,
                   help="issue each call with async_op=True and finish it with work.wait() ('wait') or "
                        "work.get_future().wait() ('future': the path DDP's communication hooks take); default: "
                        "blocking calls")
    p.add_argument("--schedules", default=None, metavar="PATH",
                   help="custom schedule files or directories for plait (as PLAIT_SCHEDULES; docs/schedules.md)")
    p.add_argument("--nproc", type=int, default=None, help="local ranks to spawn (default 2; ignored under torchrun)")
    add_json_option(p, help="write every figure as JSON to PATH; `--json -` (or --json alone) to stdout instead of "
                    "the tables")
    p.add_argument("--plot", metavar="FILE.png", help="busbw and latency against size, a line per backend")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the whole run is abandoned")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Refuses (usage error, exit 2) what the parser lets through but no sweep can run: an empty
    range of sizes, a factor that never grows the size, no timed iterations, no ranks."""
    if args.minbytes > args.maxbytes:
        parser.error(f"-b/--minbytes {_human(args.minbytes)} is above -e/--maxbytes {_human(args.maxbytes)}: "
                     "no size to measure")
    if not args.stepfactor > 1:
        parser.error(f"-f/--stepfactor {args.stepfactor:g} must be above 1 (each size is the previous one times it)")
    if args.iters < 1:
        parser.error(f"-n/--iters {args.iters} must be at least 1")
    if args.warmup < 0:
        parser.error(f"-w/--warmup {args.warmup} must be 0 or more")
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc {args.nproc} must be at least 1")
    if not args.timeout > 0:
        parser.error(f"--timeout {args.timeout:g} must be above 0 seconds")
    if not [b for b in args.backend.split(",") if b.strip()]:
        parser.error(f"--backend {args.backend!r}: name at least one backend, e.g. plait,gloo")
    if args.op == "sendrecv" and any(b.strip().startswith("plait:") for b in args.backend.split(",")):
        parser.error("--backend plait:ALGO forces a collective's algorithm; --op sendrecv has none")


# ---------------------------------------------------------------- rank side

def _torch_dtype(torch, name):
    return {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16,
            "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8}[name]


def _tensors(torch, op, S, n, rank, dt):
    """Buffers for one size, S bytes by the nccl-tests definition, filled so results are exact."""
    es = torch.tensor([], dtype=dt).element_size()
    count = max(1, S // es)
    fill = float(rank % 4 + 1)
    if op in ("allgather", "reduce_scatter", "alltoall"):
        per = max(1, count // n)
        if op == "allgather":
            return torch.full((per,), fill, dtype=dt), torch.empty(per * n, dtype=dt), per * n * es
        if op == "reduce_scatter":
            return torch.full((per * n,), fill, dtype=dt), torch.empty(per, dtype=dt), per * n * es
        return torch.full((per * n,), fill, dtype=dt), torch.empty(per * n, dtype=dt), per * n * es
    return torch.full((count,), fill, dtype=dt), torch.empty(0, dtype=dt), count * es


def _runner(dist, op, x, y, n, rank, async_op=None):
    """One call of `op`: blocking, or (`async_op`) issued asynchronously and finished at once."""
    if async_op is None or op == "sendrecv":  # sendrecv is asynchronous already
        return _call(dist, op, x, y, n, rank, {})
    call = _call(dist, op, x, y, n, rank, {"async_op": True})
    if async_op == "future":
        return lambda: call().get_future().wait()
    return lambda: call().wait()


def _call(dist, op, x, y, n, rank, kw):
    if op == "allreduce":
        return lambda: dist.all_reduce(x, **kw)
    if op == "allgather":
        return lambda: dist.all_gather_into_tensor(y, x, **kw)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(y, x, **kw)
    if op == "broadcast":
        return lambda: dist.broadcast(x, 0, **kw)
    if op == "alltoall":
        return lambda: dist.all_to_all_single(y, x, **kw)
    peer_to, peer_from = (rank + 1) % n, (rank - 1) % n

    def sendrecv():
        if n == 1:
            return
        buf = y if y.numel() == x.numel() else x.clone()
        ops = [dist.P2POp(dist.isend, x, peer_to), dist.P2POp(dist.irecv, buf, peer_from)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    if y.numel() != x.numel():
        y.resize_(x.numel())
    return sendrecv


class _TcpRing:
    """The transport floor of an allreduce: every rank sends 2(n-1)/n * S bytes to the next rank
    over one plain TCP stream while receiving as much from the previous one (what a ring moves,
    without its reductions, copies or step boundaries). A collective cannot beat this on links
    where the kernel's copies are the bottleneck (loopback on a small machine)."""

    def __init__(self, store, rank, n):
        import socket

        self.n = n
        if n == 1:
            return
        master = os.environ["MASTER_ADDR"]
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect((socket.gethostbyname(master), 9))
        host = probe.getsockname()[0]
        probe.close()
        ls = socket.socket()
        ls.bind((host, 0))
        ls.listen(1)
        store.set(f"tcp-ring/{rank}", f"{host}:{ls.getsockname()[1]}")
        peer_host, peer_port = store.get(f"tcp-ring/{(rank + 1) % n}").decode().rsplit(":", 1)
        self.out = socket.create_connection((peer_host, int(peer_port)))
        self.inp, _ = ls.accept()
        ls.close()
        for sock in (self.out, self.inp):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def runner(self, S):
        import threading

        import numpy as np

        from .doctor import recv_into

        if self.n == 1:
            return lambda: None
        nbytes = max(1, 2 * (self.n - 1) * S // self.n)
        src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

        def run():
            t = threading.Thread(target=self.out.sendall, args=(memoryview(src),))
            t.start()
            recv_into(self.inp, dst, "tcp-ring: the stream from the previous rank")
            t.join()
        return run

    def close(self):
        if self.n > 1:
            self.out.close()
            self.inp.close()


def _expected(torch, op, n, rank, dt):
    fills = [float(r % 4 + 1) for r in range(n)]
    if op in ("allreduce", "reduce_scatter"):
        return sum(fills)
    if op == "broadcast":
        return fills[0]
    if op == "sendrecv":
        return fills[(rank - 1) % n] if n > 1 else None
    return None  # allgather / alltoall: block i holds rank i's fill


def _count_wrong(torch, op, x, y, n, rank, dt):
    want = _expected(torch, op, n, rank, dt)
    if op == "allreduce" or op == "broadcast":
        return int((x.double() != want).sum())
    if op == "reduce_scatter":
        return int((y.double() != want).sum())
    if op == "sendrecv":
        return 0 if want is None else int((y.double() != want).sum())
    # allgather and alltoall: block i came from rank i
    blocks = y.double().reshape(n, -1)
    ref = torch.tensor([float(r % 4 + 1) for r in range(n)], dtype=torch.float64)[:, None]
    return int((blocks != ref).sum())


def _algorithm(dist, backend, op, S, n):
    if backend == "tcp-ring":
        return "raw ring"
    if backend.split(":")[0] != "plait" or op == "sendrecv":
        return "-"
    try:
        pg = dist.distributed_c10d._get_default_group()
        comm = pg.plait_comm
        return comm.algorithm_for(op, S)
    except Exception:  # the algorithm column is informative only
        return "?"


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    import plait.torch  # noqa: F401  (registers the backend)

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, rank == 0,
                      timeout=timedelta(seconds=args.timeout))
    dt = _torch_dtype(torch, args.dtype)
    if args.wire:
        os.environ["PLAIT_WIRE_DTYPE"] = args.wire
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    steps = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    results = []
    progress = sys.stdout if rank == 0 and args.out else None
    total = len(steps) * len(backends)
    done = 0
    for backend in backends:
        raw = backend == "tcp-ring"
        if raw and args.op != "allreduce":
            raise SystemExit("plait bench: the tcp-ring floor is defined for --op allreduce only")
        # The floor still needs a group to gather the timings: gloo's.
        name, _, algo = backend.partition(":")
        kw = {}
        if name == "plait" and (algo or args.schedules):
            from plait.torch import PlaitOptions

            kw["pg_options"] = PlaitOptions(algo=f"{args.op}:{algo}" if algo else None, schedules=args.schedules)
        dist.init_process_group("gloo" if raw else name, store=dist.PrefixStore(f"bench/{backend}", store),
                                rank=rank, world_size=n, timeout=timedelta(seconds=args.timeout), **kw)
        ring = _TcpRing(dist.PrefixStore("bench/tcp-ring", store), rank, n) if raw else None
        for S in steps:
            x, y, S_real = _tensors(torch, args.op, S, n, rank, dt)
            run = ring.runner(S_real) if raw else _runner(dist, args.op, x, y, n, rank, args.async_op)
            for _ in range(args.warmup):
                run()
            times = [0.0] * args.iters
            loop_start = time.perf_counter()
            for i in range(args.iters):
                t0 = time.perf_counter()
                run()
                times[i] = time.perf_counter() - t0
            mean = (time.perf_counter() - loop_start) / max(1, args.iters)
            ts = sorted(times)
            own = torch.tensor([ts[len(ts) // 2], ts[min(len(ts) - 1, int(round(0.99 * (len(ts) - 1))))], mean],
                               dtype=torch.float64)
            # Each rank's own percentiles; the slowest rank's figures are reported.
            dist.all_reduce(own, op=dist.ReduceOp.MAX)
            p50, p99, mean = own.tolist()
            wrong = 0
            if args.check and not raw:
                x2, y2, _ = _tensors(torch, args.op, S, n, rank, dt)
                _runner(dist, args.op, x2, y2, n, rank)()
                w = torch.tensor([_count_wrong(torch, args.op, x2, y2, n, rank, dt)], dtype=torch.float64)
                dist.all_reduce(w)
                wrong = int(w.item())
            algbw = S_real / p50 / 1e9
            results.append({
                "backend": backend, "op": args.op, "dtype": args.dtype, "size": S_real,
                "count": x.numel(), "algorithm": _algorithm(dist, backend, args.op, S_real, n),
                "time_p50_us": p50 * 1e6, "time_p99_us": p99 * 1e6, "time_mean_us": mean * 1e6, "algbw_GBps": algbw,
                "busbw_GBps": algbw * busbw_factor(args.op, n), "wrong": wrong,
            })
            done += 1
            if progress:
                print(f"PROGRESS {done} {total} {backend} {S_real}", flush=True)
            del x, y
        if ring is not None:
            ring.close()
        dist.destroy_process_group()
    if rank == 0:
        payload = {"world_size": n, "op": args.op, "dtype": args.dtype, "wire": args.wire or os.environ.get("PLAIT_WIRE_DTYPE"),
                   "async_op": args.async_op,
                   "backends": backends, "iters": args.iters, "warmup": args.warmup, "results": results}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(payload, f)
        else:
            report(payload, args)
    return 1 if any(r["wrong"] for r in results) else 0


# ---------------------------------------------------------------- launcher and report

def _human(b: int) -> str:
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= m and b % m == 0:
            return f"{b // m}{unit}"
    return str(b)


def report(payload: dict, args) -> None:
    """The tables on stdout (and the JSON written to --json PATH), or with `--json -` the JSON
    alone on stdout."""
    from ._ui import Console, Table

    if to_stdout(args.json):
        write_json(args.json, payload)
        if args.plot:
            plot(payload, args.plot)
        return
    console = Console(width=max(Console().width, 100))
    backends = payload["backends"]
    n = payload["world_size"]
    by = {(r["backend"], r["size"]): r for r in payload["results"]}
    all_sizes = sorted({r["size"] for r in payload["results"]})
    for b in backends:
        title = f"{b}: {payload['op']} {payload['dtype']}, {n} ranks"
        if payload.get("async_op") and b != "tcp-ring" and payload["op"] != "sendrecv":
            title += f", async_op then {'work.wait()' if payload['async_op'] == 'wait' else 'get_future().wait()'}"
        if b == "plait" and payload.get("wire"):
            title += f", wire {payload['wire']}"
        table = Table(title=title)
        for col in ("size", "count", "algorithm", "p50 us", "p99 us", "mean us", "algbw", "busbw", "#wrong"):
            table.add_column(col, justify="left" if col == "algorithm" else "right")
        for S in all_sizes:
            r = by.get((b, S))
            if r is None:
                continue
            table.add_row(_human(S), str(r["count"]), r["algorithm"], f"{r['time_p50_us']:.1f}",
                          f"{r['time_p99_us']:.1f}", f"{r['time_mean_us']:.1f}", f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}",
                          f"[red]{r['wrong']}[/red]" if r["wrong"] else "0")
        console.print(table)
    if len(backends) >= 2:
        base = backends[-1]
        table = Table(title=f"ratios against {base} (time: below 1 is faster; busbw: above 1 is faster)")
        table.add_column("size", justify="right")
        for b in backends[:-1]:
            table.add_column(f"p50 {b}/{base}", justify="right")
            table.add_column(f"mean {b}/{base}", justify="right")
            table.add_column(f"busbw {b}/{base}", justify="right")
        for S in all_sizes:
            ref = by.get((base, S))
            cells = [_human(S)]
            for b in backends[:-1]:
                r = by.get((b, S))
                if r is None or ref is None:
                    cells += ["-", "-", "-"]
                    continue
                cells += [f"{r['time_p50_us'] / ref['time_p50_us']:.2f}",
                          f"{r['time_mean_us'] / ref['time_mean_us']:.2f}",
                          f"{r['busbw_GBps'] / ref['busbw_GBps']:.2f}" if ref["busbw_GBps"] else "-"]
            table.add_row(*cells)
        console.print(table)
    console.print("algbw and busbw in GB/s (1e9 bytes); p50/p99: each rank's own percentiles, the slowest rank's shown;"
                  " mean: loop time / iterations (back-to-back calls), the slowest rank's.")
    if args.json:
        write_json(args.json, payload)
        console.print(f"wrote {args.json}")
    if args.plot:
        plot(payload, args.plot)
        console.print(f"wrote {args.plot}")


def plot(payload: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plait bench --plot needs matplotlib: pip install matplotlib") from None
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(11, 4))
    for b in payload["backends"]:
        rs = sorted((r for r in payload["results"] if r["backend"] == b), key=lambda r: r["size"])
        xs = [r["size"] for r in rs]
        bw.plot(xs, [r["busbw_GBps"] for r in rs], marker="o", label=b)
        lat.plot(xs, [r["time_p50_us"] for r in rs], marker="o", label=b)
    for ax, ylabel in ((bw, "busbw (GB/s)"), (lat, "time p50 (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    lat.set_yscale("log")
    fig.suptitle(f"{payload['op']} {payload['dtype']}, {payload['world_size']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def launch(args) -> int:
    """Spawns the local ranks, shows progress, prints rank 0's report."""
    from ._ui import Console, Progress

    n = args.nproc or 2
    port = _free_port()
    out = tempfile.NamedTemporaryFile(prefix="plait-bench-", suffix=".json", delete=False).name
    argv = [a for a in sys.argv[1:] if a != "bench"]
    procs = []
    deadline = time.monotonic() + args.timeout
    try:
        for r in range(n):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            cmd = [sys.executable, "-m", "plait.tools.bench", "--worker", "--out", out, *argv]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                          text=True, **popen_kwargs()))
        with Progress(transient=True, console=Console(stderr=to_stdout(args.json))) as bar:
            task = bar.add_task("measuring", total=None)
            for line in procs[0].stdout:
                if line.startswith("PROGRESS"):
                    _, done, total, backend, size = line.split()
                    bar.update(task, completed=int(done), total=int(total),
                               description=f"{backend} {_human(int(size))}")
                if time.monotonic() > deadline:
                    break
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        if any(c is None for c in codes):
            print(f"plait bench: ranks did not finish within --timeout {args.timeout:.0f} s", file=sys.stderr)
            return 2
        if not os.path.exists(out) or os.path.getsize(out) == 0:
            print(f"plait bench: rank 0 produced no results (exit codes {codes})", file=sys.stderr)
            return 2
        with open(out) as f:
            payload = json.load(f)
        report(payload, args)
        return 0 if all(c == 0 for c in codes) else 1
    finally:
        for p in procs:
            kill_group(p)
        if os.path.exists(out):
            os.unlink(out)


# What torchrun (and `plait testbed run`) set for each rank it starts.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run(args) -> int:
    under_launcher = all(k in os.environ for k in LAUNCHER_ENV)
    if args.worker or (under_launcher and args.nproc is None):
        return worker(args)
    return launch(args)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
