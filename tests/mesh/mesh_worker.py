"""One rank of a mesh test, run inside a testbed node: `python mesh_worker.py <scenario> [json args]`.
Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Prints JSON lines prefixed with '@@':
{"ev": "comm", routes, topology}, {"ev": "ready"}, {"ev": "result", ...}. Exit status 0 when
every check passed."""

import json
import os
import sys
import time
import traceback

import numpy as np

import plait
from plait.tools.doctor import DoctorStore


def emit(**ev):
    sys.stdout.write("@@" + json.dumps(ev) + "\n")
    sys.stdout.flush()


def collectives(comm, rank, n):
    """Every collective once on a few sizes and dtypes; returns a list of failures."""
    fails = []

    def check(name, got, want):
        if got is None and want is None:
            return
        if not np.array_equal(np.asarray(got), np.asarray(want)):
            fails.append(f"{name}: got {np.asarray(got).ravel()[:6]} want {np.asarray(want).ravel()[:6]}")

    for count in (1, 4099, 300_001):
        for dt in (np.float32, np.int64, np.float64):
            x = (np.arange(count) % 13 + rank).astype(dt)
            allx = [(np.arange(count) % 13 + r).astype(dt) for r in range(n)]
            s = sum(allx)
            tag = f"{np.dtype(dt).name} x {count}"
            check(f"allreduce sum {tag}", comm.allreduce(x), s)
            check(f"allreduce max {tag}", comm.allreduce(x, "max"), np.maximum.reduce(allx))
            root = count % n
            r = comm.reduce(x, root)
            check(f"reduce {tag}", r if rank == root else None, s if rank == root else None)
            b = x.copy()
            check(f"broadcast {tag}", comm.broadcast(b, root), allx[root])
            check(f"allgather {tag}", comm.allgather(x), np.stack(allx))
            check(f"reduce_scatter {tag}", comm.reduce_scatter(np.tile(x, n)), s)
            g = comm.gather(x, root)
            check(f"gather {tag}", g if rank == root else None, np.stack(allx) if rank == root else None)
            out = np.empty(count, dt)
            src = np.concatenate([np.full(count, j, dt) for j in range(n)])
            check(f"scatter {tag}", comm.scatter(src, root, out), np.full(count, rank, dt))
            a = np.concatenate([np.full(count, 10 * rank + j, dt) for j in range(n)])
            check(f"alltoall {tag}", comm.alltoall(a), np.concatenate([np.full(count, 10 * i + rank, dt)
                                                                        for i in range(n)]))
            got = np.empty(count, dt)
            w = comm.recv(got, (rank - 1) % n, tag=5, async_op=True)
            comm.send(x, (rank + 1) % n, tag=5)
            w.wait(30)
            check(f"send/recv ring {tag}", got, allx[(rank - 1) % n])
    counts = [r + 1 for r in range(n)]
    check("allgather_v", comm.allgather_v(np.full(counts[rank], rank, np.int32), counts),
          np.repeat(np.arange(n), counts))
    comm.barrier()
    return fails


def main():
    scenario = sys.argv[1]
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = float(args.get("timeout", 30))
    store = DoctorStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank == 0, 30)
    try:
        comm = plait.Communicator(store, rank, n, timeout=timeout)
    except Exception as e:
        emit(ev="comm_error", rank=rank, err=f"{type(e).__name__}: {e}")
        return 1
    emit(ev="comm", rank=rank, routes=[dict(r) for r in comm.routes()], topology=comm.topology(),
         algo=comm.algorithm_for("allreduce", 64 * 2**20))
    code = 0
    try:
        if scenario == "collectives":
            fails = collectives(comm, rank, n)
            emit(ev="result", rank=rank, fails=fails[:20], nfails=len(fails))
            code = 1 if fails else 0
        elif scenario == "routes":
            comm.barrier()
            x = comm.allreduce(np.full(1000, rank + 1, np.float32))
            emit(ev="result", rank=rank, ok=bool(np.all(x == n * (n + 1) / 2)))
        elif scenario == "cable_down":
            # Allreduce until it fails: the parent takes a cable down once every rank said "ready".
            x = np.ones(args.get("count", 2**20), np.float32)
            comm.allreduce(x)
            emit(ev="ready", rank=rank)
            t_end = time.monotonic() + float(args.get("max_seconds", 60))
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                try:
                    comm.allreduce(x, timeout=float(args["op_timeout"]))
                except plait.PlaitError as e:
                    emit(ev="result", rank=rank, err=f"{type(e).__name__}: {e}", waited=time.monotonic() - t0,
                         at=time.time())
                    return 0
            emit(ev="result", rank=rank, err=None)
            code = 1
    except Exception as e:
        emit(ev="result", rank=rank, err=f"{type(e).__name__}: {e}", trace=traceback.format_exc(limit=3))
        code = 1
    finally:
        comm.close()
        if rank == 0:
            time.sleep(0.3)  # rank 0 serves the store: let the others finish their last store calls
    return code


if __name__ == "__main__":
    sys.exit(main())
