"""One rank of a testbed allreduce measurement (used by plait.tools.testbed.bench and the demo's mesh act).

    python -m plait.tools.testbed._worker --lib plait|gloo --bytes N --iters K [--warmup W] [--timeout T]
    python -m plait.tools.testbed._worker --lib plait --op p2p --bytes N ...   # rank 0 -> rank 1 (--to R)
    python -m plait.tools.testbed._worker --lib tcp --bytes N ...              # the cables' TCP floor

Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; allreduces a float32 buffer of N bytes K times
(after W warm-up rounds), checks the result exactly, and prints one JSON line:
{"ev": "result", "lib", "rank", "times": [s, ...], "ok", "err", "algo", "topology", "routes"}.
"""

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import numpy as np


def emit(**ev):
    sys.stdout.write("@@" + json.dumps(ev) + "\n")
    sys.stdout.flush()


def _plait(args, rank, n):
    import plait
    from plait.tools.doctor import DoctorStore  # small store: no torch import (seconds) in every rank

    store = DoctorStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank == 0, args.timeout)
    comm = plait.Communicator(store, rank, n, timeout=args.timeout)
    try:
        count = args.bytes // 4
        x = np.full(count, rank + 1, np.float32)
        want = n * (n + 1) / 2
        out = np.empty_like(x)
        info = {"algo": comm.algorithm_for("allreduce", args.bytes), "routes": _routes(comm),
                "topology": comm._comm.topology() if hasattr(comm._comm, "topology") else None,
                "ring_order": comm.ring_order(), "links": comm.link_matrix()}
        info["predicted_s"], info["schedule"] = comm.predict("allreduce", args.bytes)
        for _ in range(args.warmup):
            comm.allreduce(x, out=out)
        times, ok = [], True
        for _ in range(args.iters):
            comm.barrier()
            t0 = time.perf_counter()
            comm.allreduce(x, out=out)
            times.append(time.perf_counter() - t0)
            ok = ok and bool(out[0] == want and out[-1] == want and out[count // 2] == want)
        ok = ok and bool(np.all(out == want))
        return dict(info, times=times, ok=ok)
    finally:
        comm.close()
        if rank == 0:
            time.sleep(0.3)  # rank 0 serves the store: let the others finish their last calls


def _plait_p2p(args, rank, n):
    """Rank 0 sends `--bytes` to rank `--to` (`--op p2p`: one message; `--op broadcast`: a broadcast
    from rank 0, which goes in pipeline segments, spread over every connection of a link),
    `--iters` times after `--warmup`; each time is the receiver's, from a barrier to the last byte
    (the receiver's times are the ones that count; with `--op broadcast`, rank `--to`'s)."""
    import plait
    from plait.tools.doctor import DoctorStore

    store = DoctorStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank == 0, args.timeout)
    comm = plait.Communicator(store, rank, n, timeout=args.timeout)
    try:
        buf = np.full(args.bytes, 7 if rank == 0 else 0, np.uint8)
        times, ok = [], True
        for i in range(args.warmup + args.iters):
            comm.barrier()
            t0 = time.perf_counter()
            if rank != 0:
                buf[:] = 0
            if args.op == "broadcast":
                comm.broadcast(buf, root=0)
            elif rank == 0:
                comm.send(buf, args.to)
            elif rank == args.to:
                comm.recv(buf, 0)
            if rank == args.to or (rank != 0 and args.op == "broadcast"):
                ok = ok and bool(buf[0] == 7 and buf[-1] == 7 and buf[len(buf) // 2] == 7)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        comm.barrier()
        return {"times": times, "ok": ok, "algo": "send/recv" if args.op == "p2p" else "broadcast", "routes": _routes(comm), "topology": None,
                "links": comm.link_matrix(), "streams": next((r["streams"] for r in comm.routes() if r["peer"] == (args.to if rank == 0 else 0)), None)}
    finally:
        comm.close()
        if rank == 0:
            time.sleep(0.3)


def _tcp_floor(args, rank, n):
    """The transport floor of an allreduce of `--bytes` S on a full mesh: every node sends 2S/N
    bytes to every other node over one plain TCP stream on the cable between them, while receiving
    as much from each (what a direct allreduce moves, without its reductions, copies or step
    boundaries; a thread per stream and direction, each releasing the GIL while the kernel
    copies). Rounds start at a barrier on the same streams. A collective cannot beat this where
    the kernel's per-packet work on the cables (veth, tbf, softirq), not the cables' rate, is the
    limit."""
    import socket
    import threading

    from plait.tools.doctor import DoctorStore, recv_into

    from . import cable_addr

    store = DoctorStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank == 0, args.timeout)
    ls = socket.socket()
    ls.bind(("0.0.0.0", 0))
    ls.listen(n)
    ls.settimeout(args.timeout)
    store.set(f"tcp-floor/{rank}", str(ls.getsockname()[1]))
    socks = {}
    try:
        for j in range(rank + 1, n):  # the lower rank of a pair connects, over the cable to j
            port = int(store.get(f"tcp-floor/{j}"))
            s = socket.create_connection((cable_addr(j, rank), port), timeout=args.timeout,
                                         source_address=(cable_addr(rank, j), 0))
            s.sendall(bytes([rank]))
            socks[j] = s
        for _ in range(rank):
            s, _addr = ls.accept()
            s.settimeout(args.timeout)
            peer = bytearray(1)
            recv_into(s, peer, "tcp floor: a peer's stream")
            socks[peer[0]] = s
        for s in socks.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        per_peer = max(1, 2 * args.bytes // n)
        src = np.ones(per_peer, np.uint8)
        dst = {j: np.empty(per_peer, np.uint8) for j in socks}

        def barrier():
            for s in socks.values():
                s.sendall(b"b")
            for s in socks.values():
                recv_into(s, bytearray(1), "tcp floor: a peer's stream")

        def exchange():
            errs = []

            def guarded(f, *a):
                try:
                    f(*a)
                except Exception as e:  # noqa: BLE001 - reported as this rank's error below
                    errs.append(e)
            threads = [threading.Thread(target=guarded, args=(s.sendall, memoryview(src))) for s in socks.values()]
            threads += [threading.Thread(target=guarded, args=(recv_into, s, dst[j], f"tcp floor: rank {j}'s stream"))
                        for j, s in socks.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errs:
                raise errs[0]

        times = []
        for i in range(args.warmup + args.iters):
            barrier()
            t0 = time.perf_counter()
            exchange()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        barrier()
        ok = all(bool(np.all(d == 1)) for d in dst.values())
        return {"times": times, "ok": ok, "algo": "plain TCP, a stream per cable", "routes": None, "topology": None}
    finally:
        for s in socks.values():
            s.close()
        ls.close()
        if rank == 0:
            time.sleep(0.3)  # rank 0 serves the store


def _routes(comm):
    out = []
    for r in comm.routes():
        out.append({k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v)) for k, v in r.items()})
    return out


def _gloo(args, rank, n):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        count = args.bytes // 4
        x = torch.full((count,), float(rank + 1), dtype=torch.float32)
        want = n * (n + 1) / 2
        for _ in range(args.warmup):
            y = x.clone()
            dist.all_reduce(y)
        times, ok = [], True
        for _ in range(args.iters):
            y = x.clone()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(y)
            times.append(time.perf_counter() - t0)
            ok = ok and bool((y == want).all())
        return {"times": times, "ok": ok, "algo": "gloo default", "routes": None, "topology": None}
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--lib", choices=("plait", "gloo", "tcp"), required=True,
                   help="tcp: the transport floor, plain TCP streams over the cables (allreduce only)")
    p.add_argument("--bytes", type=int, default=64 * 2**20)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--to", type=int, default=1, help="--op p2p: the receiving rank")
    p.add_argument("--op", choices=("allreduce", "p2p", "broadcast"), default="allreduce",
                   help="p2p: rank 0 sends --bytes to rank 1; broadcast: rank 0 broadcasts them (both plait only)")
    args = p.parse_args(argv)
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if args.op in ("p2p", "broadcast"):
            res = _plait_p2p(args, rank, n)
        else:
            res = {"plait": _plait, "gloo": _gloo, "tcp": _tcp_floor}[args.lib](args, rank, n)
        emit(ev="result", lib=args.lib, rank=rank, bytes=args.bytes, err=None, **res)
        return 0 if res["ok"] else 1
    except Exception as e:
        emit(ev="result", lib=args.lib, rank=rank, bytes=args.bytes, times=[], ok=False,
             err=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=3))
        return 1


if __name__ == "__main__":
    sys.exit(main())
