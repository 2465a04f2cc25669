"""Every collective x dtype x op x size x in/out of place, checked against numpy on every rank.

Each section is a generator of plan.Case: the worker runs the cases (run(ctx) returns None or
what is wrong), and test_collectives.py lists the same cases before the world starts, one test per
group. A case's inputs come from a seed made of its name, so every rank can build every rank's."""

import hashlib
import time
import zlib
from functools import partial

import numpy as np

from plan import Batch, Case, selected
from refs import (DTYPES, EPS, FLOATS, compare, gen, gen_normal, ops_for, reduce, split,
                  uneven_counts)

SIZES = (0, 1, 7, 4099)
BIG = 2**20 + 3
ALL = tuple(DTYPES)
TIMEOUT = 60.0


def sections(n):
    """(section, cases) in the order a world of n ranks runs them."""
    return [
        ("streams", streams_cases(n)),
        ("allreduce", allreduce_cases(n)),
        ("reduce", reduce_cases(n)),
        ("reduce_scatter", reduce_scatter_cases(n)),
        ("broadcast", broadcast_cases(n)),
        ("allgather", allgather_cases(n)),
        ("gather", gather_cases(n)),
        ("scatter", scatter_cases(n)),
        ("alltoall", alltoall_cases(n)),
        ("big", big_cases(n)),
        ("async", async_cases(n)),
        ("p2p", p2p_cases(n)),
        ("back_to_back", back_to_back_cases(n)),
        ("bit_identical", bit_identical_cases(n)),
    ]


def plan(n, only=None):
    """Every case a world of n ranks runs (PLAIT_TEST_SECTIONS, or `only`, applied)."""
    return [case for _, cases in selected(sections(n), only) for case in cases]


def run(ctx):
    ctx.sections(sections(ctx.n), timeout=TIMEOUT)


# -- helpers -------------------------------------------------------------------------------------
def seed_of(name):
    return zlib.crc32(name.encode())


def combos():
    """(dtype, op) pairs for a reducing collective: every dtype with every op it supports."""
    for dt in ALL:
        for op in ops_for(dt):
            yield dt, op


def factor_for(seed, op):
    if op != "premul_sum":
        return None
    return 0.5 if seed % 2 else 1.0 / 3.0


def ulps_for(op):
    return 2 if op in ("avg", "premul_sum") else 0


def everyone(seed, n, count, dt, op="sum"):
    return [gen(seed, r, count, dt, op) for r in range(n)]


def unchanged(x, before):
    return None if np.array_equal(x.view(np.uint8), before.view(np.uint8)) else "input was modified"


def first(*problems):
    for p in problems:
        if p:
            return p
    return None


def place(inplace):
    return "in-place" if inplace else "out-place"


# -- reductions ----------------------------------------------------------------------------------
# `prefix` names the group of a section that reuses these (big:, an algorithm: in cases_algorithms).
def allreduce_cases(n, sizes=SIZES, kinds=None, prefix=""):
    for dt, op in kinds or combos():
        for count in sizes:
            for inplace in (False, True):
                name = f"allreduce {dt} {op} n={count} {place(inplace)}"
                yield Case(name, f"{prefix}allreduce-{dt}-{op}", partial(allreduce_one, name, dt, op, count, inplace))


def allreduce_one(name, dt, op, count, inplace, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    f = factor_for(seed, op)
    xs = everyone(seed, n, count, dt, op)
    want = reduce(xs, dt, op, f)
    x = xs[me].copy()
    if inplace:
        y = comm.allreduce(x, op, out=x, factor=f, timeout=TIMEOUT)
        return first(None if np.shares_memory(y, x) or count == 0 else "result is not x",
                     compare(x, want, dt, ulps_for(op)))
    y = comm.allreduce(x, op, factor=f, timeout=TIMEOUT)
    return first(compare(y, want, dt, ulps_for(op)), unchanged(x, xs[me]),
                 None if y.shape == x.shape else f"shape {y.shape}")


def reduce_cases(n, sizes=SIZES, kinds=None, prefix=""):
    for dt, op in kinds or combos():
        for count in sizes:
            for inplace in (False, True):
                name = f"reduce {dt} {op} n={count} {place(inplace)}"
                root = seed_of(name) % n
                yield Case(f"{name} root={root}", f"{prefix}reduce-{dt}-{op}",
                           partial(reduce_one, name, root, dt, op, count, inplace))


def reduce_one(name, root, dt, op, count, inplace, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    f = factor_for(seed, op)
    xs = everyone(seed, n, count, dt, op)
    x = xs[me].copy()
    if inplace:
        y = comm.reduce(x, root, op, out=x, factor=f, timeout=TIMEOUT)
        got = x
    else:
        y = comm.reduce(x, root, op, factor=f, timeout=TIMEOUT)
        got = y
    if me == root:
        return compare(got, reduce(xs, dt, op, f), dt, ulps_for(op))
    return first(None if y is None else "non-root got a result", unchanged(x, xs[me]))


def reduce_scatter_cases(n, sizes=SIZES, kinds=None, prefix=""):
    for dt, op in kinds or combos():
        for count in sizes:
            for uneven in (False, True):
                for inplace in (False, True):
                    coll = "reduce_scatter_v" if uneven else "reduce_scatter"
                    name = f"{coll} {dt} {op} n={count} {place(inplace)}"
                    yield Case(name, f"{prefix}{coll}-{dt}-{op}",
                               partial(reduce_scatter_one, name, dt, op, count, uneven, inplace))


def reduce_scatter_one(name, dt, op, count, uneven, inplace, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    f = factor_for(seed, op)
    counts = uneven_counts(seed, n, count) if uneven else [count] * n
    xs = everyone(seed, n, sum(counts), dt, op)
    want = split(reduce(xs, dt, op, f), counts)[me]
    x = xs[me].copy()
    kw = dict(factor=f, timeout=TIMEOUT)
    if inplace:
        kw["out"] = split(x, counts)[me]
    if uneven:
        y = comm.reduce_scatter_v(x, counts, op, **kw)
    else:
        y = comm.reduce_scatter(x, op, **kw)
    p = compare(y, want, dt, ulps_for(op))
    if not inplace:
        p = p or unchanged(x, xs[me])
    return p


# -- data movement -------------------------------------------------------------------------------
def broadcast_cases(n, sizes=SIZES, dtypes=ALL, prefix=""):
    for dt in dtypes:
        for count in sizes:
            name = f"broadcast {dt} n={count}"
            root = seed_of(name) % n
            yield Case(f"{name} root={root}", f"{prefix}broadcast-{dt}", partial(broadcast_one, name, root, dt, count))


def broadcast_one(name, root, dt, count, ctx):
    comm, me = ctx.comm, ctx.rank
    seed = seed_of(name)
    x = gen(seed, me, count, dt)
    y = comm.broadcast(x, root, timeout=TIMEOUT)
    return first(compare(x, gen(seed, root, count, dt), dt),
                 None if y is x or count == 0 or np.shares_memory(x, y) else "result is not x")


def allgather_cases(n, sizes=SIZES, dtypes=ALL, prefix=""):
    for dt in dtypes:
        for count in sizes:
            for uneven in (False, True):
                for inplace in (False, True):
                    coll = "allgather_v" if uneven else "allgather"
                    name = f"{coll} {dt} n={count} {place(inplace)}"
                    yield Case(name, f"{prefix}{coll}-{dt}", partial(allgather_one, name, dt, count, uneven, inplace))


def allgather_one(name, dt, count, uneven, inplace, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    counts = uneven_counts(seed, n, count) if uneven else [count] * n
    xs = [gen(seed, r, counts[r], dt) for r in range(n)]
    want = np.concatenate(xs)
    x = xs[me].copy()
    kw = {"timeout": TIMEOUT}
    if inplace:
        out = np.zeros(sum(counts), DTYPES[dt])
        x = split(out, counts)[me]
        x[...] = xs[me]
        kw["out"] = out
    y = comm.allgather_v(x, counts, **kw) if uneven else comm.allgather(x, **kw)
    p = compare(y, want, dt)
    if not uneven and not inplace and y.shape != (n, count):
        p = p or f"shape {y.shape}, expected {(n, count)}"
    return p or unchanged(x, xs[me])


def gather_cases(n, sizes=SIZES, dtypes=ALL, prefix=""):
    for dt in dtypes:
        for count in sizes:
            for uneven in (False, True):
                for given_out in (False, True):
                    name = (f"gather {dt} n={count} {'counts' if uneven else 'equal'} "
                            f"out={'given' if given_out else 'new'}")
                    root = seed_of(name) % n
                    yield Case(f"{name} root={root}", f"{prefix}gather-{dt}",
                               partial(gather_one, name, root, dt, count, uneven, given_out))


def gather_one(name, root, dt, count, uneven, given_out, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    counts = uneven_counts(seed, n, count) if uneven else [count] * n
    xs = [gen(seed, r, counts[r], dt) for r in range(n)]
    kw = {"timeout": TIMEOUT, "counts": counts if uneven else None}
    if given_out and me == root:
        kw["out"] = np.full(sum(counts), 1, DTYPES[dt])
    y = comm.gather(xs[me].copy(), root, **kw)
    if me == root:
        return compare(y, np.concatenate(xs), dt)
    return None if y is None else "non-root got a result"


def scatter_cases(n, sizes=SIZES, dtypes=ALL, prefix=""):
    for dt in dtypes:
        for count in sizes:
            for uneven in (False, True):
                name = f"scatter {dt} n={count} {'counts' if uneven else 'equal'}"
                root = seed_of(name) % n
                yield Case(f"{name} root={root}", f"{prefix}scatter-{dt}",
                           partial(scatter_one, name, root, dt, count, uneven))


def scatter_one(name, root, dt, count, uneven, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    counts = uneven_counts(seed, n, count) if uneven else [count] * n
    src = gen(seed, root, sum(counts), dt)
    out = np.full(counts[me], 1, DTYPES[dt])
    y = comm.scatter(src.copy() if me == root else None, root, out,
                     counts=counts if uneven else None, timeout=TIMEOUT)
    return first(compare(out, split(src, counts)[me], dt),
                 None if y is out or count == 0 or np.shares_memory(y, out) else "result is not out")


def alltoall_cases(n, sizes=SIZES, dtypes=ALL, prefix=""):
    for dt in dtypes:
        for count in sizes:
            for uneven in (False, True):
                for given_out in (False, True):
                    coll = "alltoall_v" if uneven else "alltoall"
                    name = f"{coll} {dt} n={count} out={'given' if given_out else 'new'}"
                    yield Case(name, f"{prefix}{coll}-{dt}", partial(alltoall_one, name, dt, count, uneven, given_out))


def alltoall_one(name, dt, count, uneven, given_out, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    if uneven:  # m[i][j]: elements rank i sends to rank j
        m = [uneven_counts(seed + i, n, count) for i in range(n)]
    else:
        m = [[count] * n for _ in range(n)]
    xs = [gen(seed, i, sum(m[i]), dt) for i in range(n)]
    want = np.concatenate([split(xs[j], m[j])[me] for j in range(n)])
    x = xs[me].copy()
    kw = {"timeout": TIMEOUT}
    if given_out:
        kw["out"] = np.full(want.size, 1, DTYPES[dt])
    if uneven:
        y = comm.alltoall_v(x, m[me], [m[j][me] for j in range(n)], **kw)
    else:
        y = comm.alltoall(x, **kw)
    return first(compare(y, want, dt), unchanged(x, xs[me]))


def big_cases(n):
    """1 MiB + 3 elements: a few dtypes and ops, every collective."""
    small_world = n <= 4
    kinds = [("f32", "sum"), ("bf16", "sum")] + ([("i32", "max"), ("f16", "max")] if small_world else [])
    per_rank = BIG // n + 1  # keeps the total near BIG for the collectives that multiply by n
    big = "big:"
    yield from allreduce_cases(n, sizes=(BIG,), kinds=kinds, prefix=big)
    yield from reduce_cases(n, sizes=(BIG,), kinds=[("f32", "sum")], prefix=big)
    yield from reduce_scatter_cases(n, sizes=(per_rank,),
                                    kinds=[("f32", "sum")] + ([("bf16", "max")] if small_world else []), prefix=big)
    yield from broadcast_cases(n, sizes=(BIG,), dtypes=("f32", "u8"), prefix=big)
    yield from allgather_cases(n, sizes=(per_rank,), dtypes=("f32",), prefix=big)
    yield from gather_cases(n, sizes=(per_rank,), dtypes=("bf16",), prefix=big)
    yield from scatter_cases(n, sizes=(per_rank,), dtypes=("i16",), prefix=big)
    yield from alltoall_cases(n, sizes=(per_rank,), dtypes=("f32",), prefix=big)


# -- async, point to point, repetition, determinism ----------------------------------------------------
ASYNC_MIX = ("allreduce f32", "allgather i32", "broadcast bf16", "allreduce in place i64 max", "reduce_scatter f64",
             "alltoall u8", "barrier")


def async_cases(n):
    """Several different operations outstanding at once, waited for in reverse order; then many
    of the same kind."""
    for count in (7, 4099, 65537):
        name = f"async mix n={count}"
        batch = Batch(partial(async_mix, name, count))
        for what in reversed(ASYNC_MIX):
            yield Case(f"{name}: {what}", "async-mix", partial(batch.problem, what))
    name = "async 16 allreduces"
    batch = Batch(partial(async_many, name))
    for i in reversed(range(16)):
        yield Case(f"{name} #{i}", "async-many", partial(batch.problem, i))


def async_mix(name, count, ctx):
    """{what: problem} for the operations of ASYNC_MIX, all posted before any is waited for."""
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    x1 = gen(seed + 1, me, count, "f32")
    x2 = gen(seed + 2, me, count, "i32")
    x3 = gen(seed + 3, me, count, "bf16")
    x4 = gen(seed + 4, me, count, "i64", "max")
    x5 = gen(seed + 5, me, n * count, "f64")
    x6 = gen(seed + 6, me, n * count, "u8")
    b4 = x4.copy()
    expected = [
        (reduce(everyone(seed + 1, n, count, "f32"), "f32", "sum"), "f32"),
        (np.concatenate(everyone(seed + 2, n, count, "i32")), "i32"),
        (gen(seed + 3, n - 1, count, "bf16"), "bf16"),
        (reduce(everyone(seed + 4, n, count, "i64", "max"), "i64", "max"), "i64"),
        (split(reduce(everyone(seed + 5, n, n * count, "f64"), "f64", "sum"), [count] * n)[me], "f64"),
        (np.concatenate([split(gen(seed + 6, j, n * count, "u8"), [count] * n)[me] for j in range(n)]), "u8"),
        (None, None),
    ]
    works = [
        comm.allreduce(x1, async_op=True),
        comm.allgather(x2, async_op=True),
        comm.broadcast(x3, n - 1, async_op=True),
        comm.allreduce(b4, "max", out=b4, async_op=True),
        comm.reduce_scatter(x5, async_op=True),
        comm.alltoall(x6, async_op=True),
        comm.barrier(async_op=True),
    ]
    problems = {}
    for w, what, (want, dt) in reversed(list(zip(works, ASYNC_MIX, expected))):
        if not w.wait(TIMEOUT):
            problems[what] = "not complete after wait"
            continue
        p = None if w.is_completed() else "is_completed() is False after wait()"
        if want is not None:
            p = p or compare(w.result(), want, dt)
        problems[what] = p
    return problems


def async_many(name, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    xs = [gen(seed + i, me, 1000 + i, "f32") for i in range(16)]
    works = [comm.allreduce(x, async_op=True) for x in xs]
    return {i: compare(works[i].result(TIMEOUT), reduce(everyone(seed + i, n, 1000 + i, "f32"), "f32", "sum"), "f32")
            for i in reversed(range(16))}


def p2p_cases(n):
    if n == 1:
        return
    for dt in ALL:
        for count in SIZES + (BIG,) if dt == "f32" else SIZES:
            name = f"send/recv ring {dt} n={count}"
            yield Case(name, f"p2p-{dt}", partial(ring_one, name, dt, count))
    yield Case("send/recv tags out of order", "p2p-tags", partial(tags_out_of_order, "send/recv tags out of order"))
    yield Case("recv from any source", "p2p-any-source", partial(recv_from_any_source, "recv from any source"))


def ring_one(name, dt, count, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    dst, src = (me + 1) % n, (me - 1) % n
    seed = seed_of(name)
    out = np.zeros(count, DTYPES[dt])
    r = comm.recv(out, src, tag=5, async_op=True, timeout=TIMEOUT)
    comm.send(gen(seed, me, count, dt), dst, tag=5, timeout=TIMEOUT)
    r.wait(TIMEOUT)
    return first(compare(out, gen(seed, src, count, dt), dt),
                 None if r.source() == src else f"source() = {r.source()}, expected {src}")


def tags_out_of_order(name, ctx):
    """Tags select messages: both sent, received in the opposite order."""
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    dst, src = (me + 1) % n, (me - 1) % n
    seed = seed_of(name)
    sends = [comm.send(gen(seed + t, me, 100, "i32"), dst, tag=t, async_op=True) for t in (1, 2)]
    outs = {t: np.zeros(100, np.int32) for t in (1, 2)}
    for t in (2, 1):
        comm.recv(outs[t], src, tag=t, timeout=TIMEOUT)
    for s in sends:
        s.wait(TIMEOUT)
    return first(*(compare(outs[t], gen(seed + t, src, 100, "i32"), "i32") for t in (1, 2)))


def recv_from_any_source(name, ctx):
    """Rank 0 receives one message from every other rank, sources not named; each message and
    the set of sources are checked (the senders' part is to send)."""
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    problems = []
    if me == 0:
        seen = set()
        for _ in range(n - 1):
            out = np.zeros(33, np.int64)
            s = comm.recv(out, None, tag=9, timeout=TIMEOUT)
            seen.add(s)
            p = compare(out, gen(seed, s, 33, "i64"), "i64")
            problems.append(p and f"from {s}: {p}")
        problems.append(None if seen == set(range(1, n)) else f"sources {sorted(seen)}")
    else:
        comm.send(gen(seed, me, 33, "i64"), 0, tag=9, timeout=TIMEOUT)
    comm.barrier(timeout=TIMEOUT)
    return first(*problems)


def streams_cases(n):
    yield Case("routes: streams per peer", "streams", report_streams)


def report_streams(ctx):
    ctx.metric("streams", streams=[r["streams"] for r in ctx.comm.routes()])


def back_to_back_cases(n):
    yield Case("1000 back-to-back allreduces", "back_to_back", back_to_back)


def back_to_back(ctx):
    """1000 small allreduces in a row, each checked."""
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    x = np.empty(16, np.float32)
    bad = 0
    t0 = time.perf_counter()
    for i in range(1000):
        x[:] = i + me + np.arange(16)
        y = comm.allreduce(x, timeout=TIMEOUT)
        if not np.array_equal(y, n * (i + np.arange(16, dtype=np.float32)) + n * (n - 1) / 2):
            bad += 1
    dt = time.perf_counter() - t0
    ctx.metric("back_to_back", n=n, us_per_op=round(dt / 1000 * 1e6, 1))
    return f"{bad} wrong results" if bad else None


def bit_identical_cases(n):
    """Non-integer floats: every rank must get exactly the same bits, close to the exact sum."""
    for dt in FLOATS:
        for count in (7, 4099, 65537) + ((BIG,) if dt == "f32" else ()):
            for op in ("sum", "avg"):
                name = f"bit-identical allreduce {dt} {op} n={count}"
                yield Case(name, f"bit_identical-{dt}-{op}", partial(bit_identical_one, name, dt, op, count))


def bit_identical_one(name, dt, op, count, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = seed_of(name)
    xs = [gen_normal(seed, r, count, dt) for r in range(n)]
    y = comm.allreduce(xs[me], op, timeout=TIMEOUT)
    exact = np.sum([a.astype(np.float64) for a in xs], axis=0)
    mag = np.sum([np.abs(a.astype(np.float64)) for a in xs], axis=0)
    if op == "avg":
        exact, mag = exact / n, mag / n
    tol = (n + 1) * EPS[dt] * mag + 1e-30
    err = np.abs(y.astype(np.float64) - exact)
    bad = np.flatnonzero(err > tol)
    ctx.digests[name] = hashlib.sha1(y.tobytes()).hexdigest()
    return (f"{bad.size} elements beyond tolerance, first {bad[:3].tolist()}: "
            f"got {y[bad[:3]].tolist()} exact {exact[bad[:3]].tolist()}" if bad.size else None)
