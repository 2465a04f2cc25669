"""Every algorithm of every collective, forced through PLAIT_ALGO (and the per-call algo= argument),
on a reduced set of dtypes, ops and sizes. The parent sets PLAIT_SEGMENT_BYTES small in one world so
that even these sizes run as many pipeline segments."""

import os

import numpy as np

import cases_collectives as cc
import plait
from refs import gen, reduce

KINDS = [("f32", "sum"), ("bf16", "sum"), ("f16", "avg"), ("i32", "max"), ("u8", "bxor"), ("bool", "min"),
         ("f64", "premul_sum"), ("i64", "prod")]
DTYPES = ("f32", "bf16", "u8", "bool", "i64")
SIZES = (0, 1, 7, 4099, 65537)
COLLECTIVES = ("allreduce", "reduce", "reduce_scatter", "broadcast", "allgather", "gather", "scatter", "alltoall")
TIMEOUT = 60.0


def run_cases(ctx, coll):
    if coll == "allreduce":
        cc.allreduce_cases(ctx, SIZES, KINDS)
    elif coll == "reduce":
        cc.reduce_cases(ctx, SIZES, KINDS)
    elif coll == "reduce_scatter":
        cc.reduce_scatter_cases(ctx, SIZES, KINDS)
    else:
        getattr(cc, f"{coll}_cases")(ctx, SIZES, DTYPES)


def run(ctx):
    names = {coll: plait._core.algorithms(coll) for coll in COLLECTIVES}
    ctx.emit("algorithms", names=names)
    for coll in COLLECTIVES:
        for algo in names[coll]:
            ctx.label = f"[PLAIT_ALGO={coll}:{algo}] "
            os.environ["PLAIT_ALGO"] = f"{coll}:{algo}"
            raised = False
            try:
                comm = ctx.new_comm(timeout=TIMEOUT)
                for nbytes in (0, 4, 16396, 2**26):
                    chosen = comm.algorithm_for(coll, nbytes)
                    ctx.check(f"algorithm_for({coll}, {nbytes})",
                              None if chosen == algo else f"selector chose {chosen!r}")
                run_cases(ctx, coll)
            except Exception as e:
                ctx.fail("(aborted)", f"{type(e).__name__}: {e}")
                raised = True
            ctx.sync(ctx.label, raised)
    os.environ.pop("PLAIT_ALGO", None)
    ctx.label = ""
    per_call(ctx, names)


def per_call(ctx, names):
    """algo= on a single call overrides the selector for that call only; the default choice is valid."""
    comm = ctx.new_comm(timeout=TIMEOUT)
    n, me = ctx.n, ctx.rank
    for coll in COLLECTIVES:
        for nbytes in (0, 4, 4096, 2**20, 2**26):
            chosen = comm.algorithm_for(coll, nbytes)
            ctx.check(f"default algorithm_for({coll}, {nbytes})",
                      None if chosen in names[coll] else f"{chosen!r} is not one of {names[coll]}")
    for algo in names["allreduce"]:
        for count in (7, 65537):
            name = f"allreduce algo={algo} n={count}"
            seed = cc.seed_of(name)
            xs = [gen(seed, r, count, "f32") for r in range(n)]
            y = comm.allreduce(xs[me], algo=algo)
            ctx.check(name, None if np.array_equal(y, reduce(xs, "f32", "sum")) else "wrong result")
