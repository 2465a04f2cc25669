"""Fault scenarios, one per world (ctx.args["scenario"]). The parent (test_faults.py) steers them
(kills or stops a rank, attacks listening ports) and checks the events written here."""

import datetime
import json
import os
import threading
import time

import numpy as np

import plait

BIG = 16 * 2**20  # f32 elements: 64 MiB


def run(ctx):
    globals()[ctx.args["scenario"]](ctx)


def _error(ctx, what, e, t0, **extra):
    """Reports an exception from a fault as an event for the parent to judge."""
    ctx.emit("error", what=what, type=type(e).__name__, msg=str(e), t_err=time.time(),
             elapsed=round(time.monotonic() - t0, 4), **extra)


def _ready(ctx, **info):
    ctx.store.set(f"ready/{ctx.rank}", json.dumps(dict(info, pid=os.getpid())).encode())


def _wait_key(ctx, key, timeout=120):
    ctx.store.wait([key], datetime.timedelta(seconds=timeout))


def _recover(ctx, members, timeout=10.0):
    """A new communicator (next epoch) among `members` works."""
    me = members.index(ctx.rank)
    comm = ctx.new_comm(rank=me, n=len(members), timeout=timeout)
    y = comm.allreduce(np.full(1000, ctx.rank + 1, np.float32))
    want = sum(r + 1 for r in members)
    ctx.check(f"recovery among {members}", None if np.all(y == want) else f"got {y[:4]}, expected {want}")


def _loop_until_error(ctx, comm, x, out, iters, what):
    """Allreduces until one raises. Checks that the failed call left `out` untouched."""
    for i in range(iters):
        out.fill(7)
        t0 = time.monotonic()
        try:
            comm.allreduce(x, out=out)
        except plait.PlaitError as e:
            _error(ctx, what, e, t0, iteration=i)
            ctx.check(f"{what}: output untouched after the failure",
                      None if np.all(out == 7) else "the failed allreduce modified the output buffer")
            return e
    ctx.fail(what, f"no error after {iters} iterations")
    return None


# -- a rank dies or stops --------------------------------------------------------------------------
def kill(ctx):
    """Parent SIGKILLs args.victim during a 64 MiB allreduce (args.count elements if given: small
    ones are read on the calling thread); the others must raise PeerError."""
    count = ctx.args.get("count", BIG)
    _peer_fault(ctx, count, f"allreduce {count * 4} B while a rank is killed")


def stop(ctx):
    """Parent SIGSTOPs args.victim; the others must raise at the (short) deadline."""
    count = ctx.args.get("count", BIG // 16)
    _peer_fault(ctx, count, f"allreduce {count * 4} B while a rank is stopped")


def _peer_fault(ctx, count, what):
    a = ctx.args
    comm = ctx.new_comm(timeout=a["timeout"])
    if a.get("subgroup"):
        # On a subgroup sharing the world's links, its ranks reversed: the dead link fails the
        # world, and through it the subgroup, whose error names the world's rank of the victim.
        world, comm = comm, comm.subgroup(list(reversed(range(ctx.n))), "reversed")
        what += " (on a subgroup)"
    x = np.full(count, ctx.rank + 1, np.float32)
    out = np.empty_like(x)
    comm.allreduce(x, out=out)
    ctx.check("warm-up allreduce", None if out[0] == ctx.n * (ctx.n + 1) / 2 else f"got {out[0]}")
    _ready(ctx)
    # Enough calls to still be looping when the parent strikes (small ones take microseconds).
    _loop_until_error(ctx, comm, x, out, 400 if count >= 2**20 else 2_000_000, what)
    if ctx.rank == a["victim"]:
        time.sleep(60)  # only reached if the parent failed to kill or stop us
        return
    _recover(ctx, [r for r in range(ctx.n) if r != a["victim"]])


# -- abort from another thread ----------------------------------------------------------------------
def abort(ctx):
    n, me = ctx.n, ctx.rank
    # A: rank n-1 is late, so ranks 0 and 1 sit inside the collective; rank 0 aborts.
    comm = ctx.new_comm(timeout=30.0)
    x = np.full(BIG, me + 1, np.float32)
    out = np.full(BIG, 7, np.float32)
    g_out = np.full(n * 2**18, 7, np.int32)
    t0 = time.monotonic()
    if me == n - 1:
        time.sleep(2.5)
        try:
            comm.allreduce(x, out=out)
            ctx.fail("abort A: late rank", "allreduce succeeded although rank 0 aborted")
        except plait.PlaitError as e:
            _error(ctx, "abort A: late rank", e, t0)
    else:
        if me == 0:
            _abort_later(ctx, comm, 0.5, "abort A")
        # A rank slow to start (a loaded machine) may issue its calls after rank 0's abort has
        # reached it: then issuing them fails, which is the same outcome.
        works = []
        for name, start in (("allreduce", lambda: comm.allreduce(x, out=out, async_op=True)),
                            ("allgather", lambda: comm.allgather(np.full(2**18, me, np.int32), out=g_out, async_op=True))):
            try:
                works.append((start(), name))
            except plait.PlaitError as e:
                _error(ctx, f"abort A: {name}", e, t0)
        for w, name in works:
            try:
                w.wait(60)
                ctx.fail(f"abort A: {name}", "completed although rank 0 aborted")
            except plait.PlaitError as e:
                _error(ctx, f"abort A: {name}", e, t0)
        ctx.check("abort A: outputs untouched",
                  None if np.all(out == 7) and np.all(g_out == 7) else "an aborted op modified its output")
    ctx.check("abort A: input untouched", None if np.all(x == me + 1) else "input modified")
    ctx.sync("abort A")

    # B: every rank loops over in-place 64 MiB allreduces; rank 0 aborts in the middle of one.
    comm = ctx.new_comm(timeout=30.0)
    buf = np.empty(BIG, np.float32)
    if me == 0:
        _abort_later(ctx, comm, 0.6, "abort B")
    t0 = time.monotonic()
    for i in range(60):
        buf.fill(me + 1)
        try:
            comm.allreduce(buf, out=buf)
        except plait.PlaitError as e:
            _error(ctx, "abort B: in-place allreduce", e, t0, iteration=i)
            ctx.check("abort B: in-place buffer untouched",
                      None if np.all(buf == me + 1) else "the failed in-place allreduce modified the buffer")
            break
    else:
        ctx.fail("abort B", "no error after 60 allreduces")
    ctx.sync("abort B")

    # C: a new epoch works; abort with nothing in flight breaks the communicator cleanly.
    comm = ctx.new_comm(timeout=30.0)
    y = comm.allreduce(np.full(4099, me, np.int64))
    ctx.check("abort C: new epoch allreduce", None if np.all(y == n * (n - 1) // 2) else f"got {y[:3]}")
    comm.barrier()
    ctx.sync("abort C: idle")  # nobody aborts while a peer may still be inside the barrier
    comm.abort("idle abort")
    try:
        comm.allreduce(np.ones(4, np.float32), timeout=5)
        ctx.fail("abort C: after idle abort", "allreduce succeeded on an aborted communicator")
    except (plait.BrokenError, plait.AbortedError):
        ctx.check("abort C: after idle abort", None)
    except plait.PlaitError as e:
        ctx.fail("abort C: after idle abort", f"{type(e).__name__}: {e} (expected BrokenError or AbortedError)")
    ctx.sync("abort C")
    _recover(ctx, list(range(n)))


def _abort_later(ctx, comm, delay, what):
    def fire():
        time.sleep(delay)
        ctx.emit("aborted", what=what, t_abort=time.time())
        comm.abort(f"test: {what}")

    threading.Thread(target=fire, daemon=True).start()


# -- ranks that disagree ----------------------------------------------------------------------------
def _mismatch_cases(n):
    """name -> (setup(me) -> (out, action(comm)), ranks whose call must fail). `out` is prefilled with
    7 and must stay so when the call fails; a rank that must fail would otherwise hold data it cannot
    trust."""
    f32 = np.float32

    def full(count, dt=f32):
        return np.full(count, 7, dt)

    def allreduce_vs_broadcast(me):
        out = full(1000)
        if me == 0:
            return out, lambda c: c.allreduce(np.ones(1000, f32), out=out)
        return out, lambda c: c.broadcast(out, 0)

    def counts(me):
        out = full(1001 if me == 1 else 1000)
        return out, lambda c: c.allreduce(np.ones(out.size, f32), out=out)

    def dtypes(me):
        dt = np.int32 if me == n - 1 else f32
        out = full(1000, dt)
        return out, lambda c: c.allreduce(np.ones(1000, dt), out=out)

    def ops(me):
        out = full(1000)
        return out, lambda c: c.allreduce(np.ones(1000, f32), "max" if me == 1 else "sum", out=out)

    def big_dtypes(me):
        import ml_dtypes

        dt = ml_dtypes.bfloat16 if me == 1 else f32
        out = full(2 * 2**20 if me == 1 else 2**20, dt)  # same bytes
        return out, lambda c: c.allreduce(np.ones(out.size, dt), out=out)

    def uneven_counts(me):
        counts = [20, 20, 20][:n] if me == n - 1 else [10, 20, 30][:n]
        out = full(counts[me])
        return out, lambda c: c.reduce_scatter_v(np.ones(sum(counts), f32), counts, out=out)

    def allgather_vs_alltoall(me):
        out = full(n * 100, np.int32)
        if me == 0:
            return out, lambda c: c.allgather(np.ones(100, np.int32), out=out)
        return out, lambda c: c.alltoall(np.ones(n * 100, np.int32), out=out)

    def broadcast_roots(me):
        out = full(1000)
        return out, lambda c: c.broadcast(out, 1 if me == 1 else 0)

    def send_recv_sizes(me):
        out = full(50)
        if me == 0:
            return out, lambda c: c.send(np.ones(100, f32), 1)
        if me == 1:
            return out, lambda c: c.recv(out, 0)
        return out, lambda c: None

    # name: (setup, ranks whose call must fail, whether some rank must raise MismatchError).
    # Ranks that disagree only on the broadcast root each get data consistent with their own view
    # (the roots send, rank 2 receives from rank 0), so detection is not required there. With
    # counts [10, 20, 30] vs [20, 20, 20], rank 1 receives 20 elements from everyone in either view,
    # so only the ranks whose sizes differ are sure to see the mismatch.
    every = set(range(n))
    return {
        "allreduce vs broadcast": (allreduce_vs_broadcast, every, True),
        "allreduce counts 1000 vs 1001": (counts, every, True),
        "allreduce f32 vs i32": (dtypes, every, True),
        "allreduce sum vs max": (ops, every, True),
        "allreduce 4 MiB f32 vs bf16": (big_dtypes, every, True),
        "reduce_scatter_v counts differ": (uneven_counts, {0, n - 1}, True),
        "allgather vs alltoall": (allgather_vs_alltoall, every, True),
        "broadcast roots differ": (broadcast_roots, set(), False),
        "send 100 / recv 50 elements": (send_recv_sizes, {1}, True),
    }


def mismatch(ctx):
    for name, (setup, _, _) in _mismatch_cases(ctx.n).items():
        comm = ctx.new_comm(timeout=ctx.args["timeout"])
        out, action = setup(ctx.rank)
        t0 = time.monotonic()
        stage = "call"
        try:
            action(comm)
            ctx.emit("mismatch", case=name, stage=stage, type=None, elapsed=round(time.monotonic() - t0, 3))
            stage = "barrier"
            comm.barrier()  # a mismatch may surface only at the next operation
            ctx.emit("mismatch", case=name, stage=stage, type=None, elapsed=round(time.monotonic() - t0, 3))
        except plait.PlaitError as e:
            ctx.emit("mismatch", case=name, stage=stage, type=type(e).__name__, msg=str(e),
                     elapsed=round(time.monotonic() - t0, 3))
            if stage == "call":
                ctx.check(f"mismatch {name}: output untouched",
                          None if np.all(out == 7) else "the failed call modified its output")
        ctx.sync(f"mismatch {name}")
    _recover(ctx, list(range(ctx.n)))


# -- garbage on a listening port ------------------------------------------------------------------
def garbage(ctx):
    comm = ctx.new_comm(timeout=20.0)
    _verify_some(ctx, comm, "before")
    _ready(ctx, port=comm._comm.listen_port())
    _wait_key(ctx, "attacked")
    _verify_some(ctx, comm, "with junk connections open")
    comm = ctx.new_comm(timeout=20.0)  # a new rendezvous after the junk
    _verify_some(ctx, comm, "new epoch with junk connections open")
    ctx.store.set(f"phase2/{ctx.rank}", b"1")
    _wait_key(ctx, "released")
    _verify_some(ctx, comm, "after junk connections closed")


def _verify_some(ctx, comm, when):
    n, me = ctx.n, ctx.rank
    t0 = time.monotonic()
    y = comm.allreduce(np.full(2**20 + 3, me + 1, np.float32))
    ok = np.all(y == n * (n + 1) / 2)
    g = comm.allgather(np.full(4099, me, np.int16))
    ok = ok and np.array_equal(g, np.repeat(np.arange(n, dtype=np.int16), 4099).reshape(n, 4099))
    b = comm.broadcast(np.full(7, me, np.int64), n - 1)
    ok = ok and np.all(b == n - 1)
    comm.barrier()
    dt = time.monotonic() - t0
    ctx.check(f"collectives {when}", None if ok else "wrong results")
    ctx.check(f"collectives {when}: speed", None if dt < 10 else f"took {dt:.1f} s")
