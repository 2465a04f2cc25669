"""One rank of `plait demo`: every collective once (checked against numpy), an allreduce size sweep,
and a raw TCP stream for comparison. Writes JSON lines to stdout for the parent (plait.tools.demo)."""

import argparse
import datetime
import json
import socket
import sys
import time

import numpy as np

from ..comm import Communicator

MiB = 2**20


def emit(**event):
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def checks(n, me):
    """(name, detail, fn(comm) -> (got, expected)) for every collective. Inputs are small integers,
    so every expected value is exact."""
    c = 4099
    x = np.arange(c, dtype=np.float32) % 17 + me
    counts = [(r % 3) * 5 + 1 for r in range(n)]
    offs = np.cumsum([0] + counts)
    total_x = lambda r: np.arange(c, dtype=np.float32) % 17 + r  # noqa: E731 - every rank's x
    sum_x = sum(total_x(r) for r in range(n))
    stacked = np.stack([np.full(c, r, np.int32) for r in range(n)])

    def p2p(comm):
        out = np.zeros(c, np.float32)
        w = comm.recv(out, (me - 1) % n, tag=1, async_op=True)
        comm.send(x, (me + 1) % n, tag=1)
        w.wait()
        return out, total_x((me - 1) % n)

    def any_source(comm):
        if me == 0:
            got = sorted(comm.recv(np.zeros(1, np.int64), None, tag=2) for _ in range(n - 1))
            return np.array(got), np.arange(1, n)
        comm.send(np.full(1, me, np.int64), 0, tag=2)
        return np.zeros(0), np.zeros(0)

    def ata_v(comm):
        send = [me + j + 1 for j in range(n)]
        recv = [i + me + 1 for i in range(n)]
        xv = np.concatenate([np.full(k, 100 * me + j, np.int16) for j, k in enumerate(send)])
        want = np.concatenate([np.full(k, 100 * i + me, np.int16) for i, k in enumerate(recv)])
        return comm.alltoall_v(xv, send, recv), want

    root = n - 1
    return [
        ("allreduce", f"f32 x {c}, sum", lambda cm: (cm.allreduce(x), sum_x)),
        ("allreduce", f"i32 x {c}, max", lambda cm: (cm.allreduce(np.full(c, me, np.int32), "max"), np.full(c, n - 1))),
        ("allreduce", f"f64 x {c}, sum, in place", lambda cm: (_in_place(cm, x.astype(np.float64)), sum_x)),
        ("reduce", f"f32 x {c} to rank {root}", lambda cm: _at_root(cm.reduce(x, root), sum_x, me == root)),
        ("broadcast", f"i64 x {c} from rank {root}", lambda cm: (cm.broadcast(np.full(c, me, np.int64), root),
                                                                 np.full(c, root))),
        ("allgather", f"i32 x {c}", lambda cm: (cm.allgather(np.full(c, me, np.int32)), stacked)),
        ("allgather_v", f"u8, counts {counts}", lambda cm: (cm.allgather_v(np.full(counts[me], me, np.uint8), counts),
                                                           np.repeat(np.arange(n), counts))),
        ("reduce_scatter", f"f32 x {n}x{c}", lambda cm: (cm.reduce_scatter(np.tile(x, n)), sum_x)),
        ("reduce_scatter_v", f"i16, counts {counts}",
         lambda cm: (cm.reduce_scatter_v(np.arange(offs[-1], dtype=np.int16), counts),
                     n * np.arange(offs[me], offs[me + 1]))),
        ("gather", f"i32 x {c} to rank {root}", lambda cm: _at_root(cm.gather(np.full(c, me, np.int32), root),
                                                                   stacked, me == root)),
        ("scatter", f"f32, {c} per rank from rank 0",
         lambda cm: (cm.scatter(np.repeat(np.arange(n, dtype=np.float32), c), 0, np.zeros(c, np.float32)),
                     np.full(c, me))),
        ("alltoall", f"i32 x {n}x{c}", lambda cm: (cm.alltoall(np.repeat(np.arange(n, dtype=np.int32) + 10 * me, c)),
                                                   np.repeat(10 * np.arange(n) + me, c))),
        ("alltoall_v", "i16, uneven splits", ata_v),
        ("barrier", "", lambda cm: (cm.barrier(), None)),
        ("send/recv", f"f32 x {c}, ring", p2p),
        ("recv any source", "to rank 0", any_source),
    ]


def _in_place(comm, buf):
    comm.allreduce(buf, out=buf)
    return buf


def _at_root(got, want, is_root):
    return (got, want) if is_root else (got, None)


def run_checks(comm, n, me, progress):
    for name, detail, fn in checks(n, me):
        progress(f"{name}")
        t0 = time.perf_counter()
        try:
            got, want = fn(comm)
            ms = (time.perf_counter() - t0) * 1e3
            ok = want is None or (got is not None and got.size == np.asarray(want).size
                                  and np.array_equal(np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)))
            emit(ev="coll", name=name, detail=detail, ok=bool(ok), ms=ms, err=None if ok else "wrong result")
        except Exception as e:
            emit(ev="coll", name=name, detail=detail, ok=False, ms=(time.perf_counter() - t0) * 1e3,
                 err=f"{type(e).__name__}: {e}")


def sweep_sizes(quick):
    top = 16 * MiB if quick else 64 * MiB
    s, out = 4096, []
    while s <= top:
        out.append(s)
        s *= 4
    return out


def run_sweep(comm, n, me, quick, progress):
    for nbytes in sweep_sizes(quick):
        progress(f"allreduce {_size(nbytes)}")
        x = np.full(nbytes // 4, me + 1, np.float32)
        out = np.empty_like(x)
        iters = max(3, min(40, (256 * MiB) // (nbytes * 8)))
        if quick:
            iters = max(3, iters // 3)
        comm.allreduce(x, out=out)  # warm-up
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            comm.allreduce(x, out=out)
            times.append(time.perf_counter() - t0)
        ok = bool(np.all(out == n * (n + 1) / 2))
        emit(ev="sweep", bytes=nbytes, algo=comm.algorithm_for("allreduce", nbytes), times=times, ok=ok)


def run_p2p(comm, me, nbytes):
    """plait send/recv of nbytes between ranks 0 and 1 (best of 3)."""
    buf = np.ones(nbytes // 4, np.float32)
    best = None
    for _ in range(3):
        comm.barrier()
        t0 = time.perf_counter()
        if me == 0:
            comm.send(buf, 1)
        elif me == 1:
            comm.recv(buf, 0)
        comm.barrier()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    emit(ev="p2p", bytes=nbytes, seconds=best)


def run_raw_tcp(store, me, nbytes):
    """A single TCP stream over loopback, Python sockets, rank 0 -> rank 1: the reference figure."""
    if me == 1:
        srv = socket.create_server(("127.0.0.1", 0))
        store.set("demo/raw_port", str(srv.getsockname()[1]).encode())
        conn, _ = srv.accept()
        buf = memoryview(bytearray(nbytes))
        best = None
        for _ in range(3):
            conn.sendall(b"g")
            t0 = time.perf_counter()
            got = 0
            while got < nbytes:
                k = conn.recv_into(buf[got:])
                if not k:
                    raise ConnectionError("raw TCP sender closed early")
                got += k
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        conn.close()
        srv.close()
        emit(ev="raw", bytes=nbytes, seconds=best)
    elif me == 0:
        store.wait(["demo/raw_port"], datetime.timedelta(seconds=60))
        port = int(store.get("demo/raw_port"))
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)
        data = memoryview(bytearray(nbytes))
        for _ in range(3):
            conn.recv(1)
            conn.sendall(data)
        conn.close()


def _size(nbytes):
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"


def main(argv):
    p = argparse.ArgumentParser(prog="python -m plait.tools.demo --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    from .._store import tcp_store

    store = tcp_store("127.0.0.1", a.port, None, False, timeout=datetime.timedelta(seconds=60))
    n, me = a.nproc, a.rank
    steps = len(checks(n, me)) + len(sweep_sizes(a.quick)) + 2

    def progress(label):
        if me == 0:
            emit(ev="progress", label=label, total=steps)

    with Communicator(store, me, n, timeout=60) as comm:
        run_checks(comm, n, me, progress)
        run_sweep(comm, n, me, a.quick, progress)
        progress("plait send/recv")
        run_p2p(comm, me, 64 * MiB)
        progress("raw TCP stream")
        run_raw_tcp(store, me, (64 if a.quick else 256) * MiB)
        comm.barrier()
    emit(ev="done")
    return 0
