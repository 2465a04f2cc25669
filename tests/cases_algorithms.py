"""Every algorithm of every collective, forced through PLAIT_ALGO (and the per-call algo= argument),
on a reduced set of dtypes, ops and sizes. The parent sets PLAIT_SEGMENT_BYTES small in one world so
that even these sizes run as many pipeline segments.

Cases are plan.Case generators (see plan.py); test_algorithms.py lists them with plan(n)."""

import os
from functools import partial

import numpy as np

import cases_collectives as cc
import plait
from plan import Case
from refs import gen, reduce

KINDS = [("f32", "sum"), ("bf16", "sum"), ("f16", "avg"), ("i32", "max"), ("u8", "bxor"), ("bool", "min"),
         ("f64", "premul_sum"), ("i64", "prod")]
DTYPES = ("f32", "bf16", "u8", "bool", "i64")
SIZES = (0, 1, 7, 4099, 65537)
COLLECTIVES = ("allreduce", "reduce", "reduce_scatter", "broadcast", "allgather", "gather", "scatter", "alltoall")
TIMEOUT = 60.0


def algorithms():
    return {coll: plait._core.algorithms(coll) for coll in COLLECTIVES}


def label(coll, algo):
    return f"[PLAIT_ALGO={coll}:{algo}] "


def forced(n, names):
    """(coll, algo, cases): one block per algorithm, run on a communicator built with it forced."""
    return [(coll, algo, forced_cases(n, coll, algo)) for coll in COLLECTIVES for algo in names[coll]]


def plan(n):
    """Every case a world of n ranks runs, in order."""
    names = algorithms()
    return [c for _, _, cases in forced(n, names) for c in cases] + list(per_call_cases(n, names))


def run(ctx):
    names = algorithms()
    ctx.emit("algorithms", names=names)
    for coll, algo, cases in forced(ctx.n, names):
        os.environ["PLAIT_ALGO"] = f"{coll}:{algo}"
        raised = False
        try:
            ctx.new_comm(timeout=TIMEOUT)
            ctx.run_cases(cases)
        except Exception as e:
            ctx.fail(f"{label(coll, algo)}(aborted)", f"{type(e).__name__}: {e}")
            raised = True
        ctx.sync(label(coll, algo), raised)
    os.environ.pop("PLAIT_ALGO", None)
    ctx.new_comm(timeout=TIMEOUT)
    ctx.run_cases(per_call_cases(ctx.n, names))


def forced_cases(n, coll, algo):
    # Names carry the label (unique across blocks); seeds come from the collective's own name.
    tag, prefix = label(coll, algo), f"{algo}:"
    for nbytes in (0, 4, 16396, 2**26):
        yield Case(f"{tag}algorithm_for({coll}, {nbytes})", f"{prefix}{coll}-selector",
                   partial(selector_chooses, coll, nbytes, algo))
    if coll == "allreduce":
        cases = cc.allreduce_cases(n, SIZES, KINDS, prefix)
    elif coll == "reduce":
        cases = cc.reduce_cases(n, SIZES, KINDS, prefix)
    elif coll == "reduce_scatter":
        cases = cc.reduce_scatter_cases(n, SIZES, KINDS, prefix)
    else:
        cases = getattr(cc, f"{coll}_cases")(n, SIZES, DTYPES, prefix)
    for case in cases:
        yield case._replace(name=tag + case.name)


def selector_chooses(coll, nbytes, algo, ctx):
    chosen = ctx.comm.algorithm_for(coll, nbytes)
    return None if chosen == algo else f"selector chose {chosen!r}"


def per_call_cases(n, names):
    """algo= on a single call overrides the selector for that call only; the default choice is valid."""
    for coll in COLLECTIVES:
        for nbytes in (0, 4, 4096, 2**20, 2**26):
            yield Case(f"default algorithm_for({coll}, {nbytes})", f"default:{coll}-selector",
                       partial(default_is_known, coll, nbytes, names[coll]))
    for algo in names["allreduce"]:
        for count in (7, 65537):
            name = f"allreduce algo={algo} n={count}"
            yield Case(name, f"per-call:allreduce-{algo}", partial(per_call_allreduce, name, algo, count))


def default_is_known(coll, nbytes, known, ctx):
    chosen = ctx.comm.algorithm_for(coll, nbytes)
    return None if chosen in known else f"{chosen!r} is not one of {known}"


def per_call_allreduce(name, algo, count, ctx):
    comm, n, me = ctx.comm, ctx.n, ctx.rank
    seed = cc.seed_of(name)
    xs = [gen(seed, r, count, "f32") for r in range(n)]
    y = comm.allreduce(xs[me], algo=algo)
    return None if np.array_equal(y, reduce(xs, "f32", "sum")) else "wrong result"
