"""Calls written the ways people write them for gloo, run by every rank of a local world on a
named backend (see test_torch_gloo_parity.py, which runs each scenario on plait and on gloo and
compares what they return).

    python tests/torch/gloo_parity_scenarios.py NAME OUTDIR BACKEND

A scenario returns {case: outcome}: a case's outcome is its result (tensors as lists) or
"raised <ExceptionClass>" when gloo would also raise, so both backends can be compared case by
case.
"""

import datetime
import os
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
R = dist.ReduceOp


def init(backend, seconds=60):
    if backend == "plait":
        import plait.torch  # noqa: F401
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))


def value(x):
    """A result as plain Python data: tensors as (dtype, shape, values)."""
    if isinstance(x, torch.Tensor):
        return (str(x.dtype), tuple(x.shape), x.tolist())
    if isinstance(x, (list, tuple)):
        return [value(v) for v in x]
    return x


def case(out, name, fn):
    try:
        out[name] = value(fn())
    except Exception as e:  # gloo's refusals are RuntimeErrors; plait's are ValueErrors too
        out[name] = f"raised {'RuntimeError' if isinstance(e, RuntimeError) else type(e).__name__}"


def scenario_keywords(args):
    """Every keyword form of the ProcessGroup methods that c10d's Python binding accepts."""
    init(args[1])
    pg, out = dist.group.WORLD, {}
    root = WORLD - 1

    def t(v=None):
        return torch.arange(4, dtype=torch.float32) + (10 * RANK if v is None else v)

    def run(work, *tensors):
        work.wait()
        return list(tensors)

    x = t()
    case(out, "broadcast(t, root=)", lambda: run(pg.broadcast(x, root=root), x))
    x = t()
    case(out, "broadcast(t, root, timeout=)", lambda: run(pg.broadcast(x, root, timeout=datetime.timedelta(seconds=30)), x))
    o = dist.BroadcastOptions()
    o.rootRank = root
    x = t()
    case(out, "broadcast([t], opts=)", lambda: run(pg.broadcast([x], opts=o), x))
    x = t()
    case(out, "allreduce(t, op=MAX)", lambda: run(pg.allreduce(x, op=R.MAX), x))
    x = t()
    case(out, "allreduce([t], op=MIN)", lambda: run(pg.allreduce([x], op=R.MIN), x))
    x = t()
    case(out, "allreduce(t, op=, timeout=)", lambda: run(pg.allreduce(x, op=R.SUM, timeout=datetime.timedelta(seconds=30)), x))
    x = t()
    case(out, "reduce(t, root=, op=)", lambda: run(pg.reduce(x, root=root, op=R.PRODUCT), x) if RANK == root else run(pg.reduce(x, root=root, op=R.PRODUCT)))
    x = t()
    outs = [torch.zeros(4) for _ in range(WORLD)] if RANK == root else []
    case(out, "gather(outs, t, root=)", lambda: run(pg.gather(outs, x, root=root), *outs))
    y = torch.zeros(4)
    ins = [t(100 * r) for r in range(WORLD)] if RANK == root else []
    case(out, "scatter(t, ins, root=)", lambda: run(pg.scatter(y, ins, root=root), y))
    y = torch.zeros(4)
    case(out, "reduce_scatter(t, ins, op=)", lambda: run(pg.reduce_scatter(y, [t(r) for r in range(WORLD)], op=R.MAX), y))
    outs = [torch.zeros(4) for _ in range(WORLD)]
    case(out, "allgather(outs, t, timeout=)", lambda: run(pg.allgather(outs, t(), timeout=datetime.timedelta(seconds=30)), *outs))
    o = torch.zeros(4 * WORLD)
    case(out, "alltoall_base(..., timeout=)", lambda: run(pg.alltoall_base(o, torch.arange(4. * WORLD) + RANK, [], [], timeout=datetime.timedelta(seconds=30)), o))
    case(out, "barrier(timeout=)", lambda: pg.barrier(timeout=datetime.timedelta(seconds=30)).wait())
    case(out, "allreduce(t, bogus=)", lambda: pg.allreduce(t(), bogus=1))
    dist.destroy_process_group()
    return out


def scenario_inference_mode(args):
    """Futures of every collective called under torch.inference_mode() (outputs made there too)."""
    init(args[1])
    out = {}
    root = WORLD - 1

    def fut(work):
        return work.get_future().wait()

    with torch.inference_mode():
        x = torch.arange(4.) + RANK
        case(out, "all_reduce", lambda: fut(dist.all_reduce(x, async_op=True)))
        outs = [torch.zeros(4) for _ in range(WORLD)]
        case(out, "all_gather", lambda: fut(dist.all_gather(outs, torch.arange(4.) + RANK, async_op=True)))
        o = torch.zeros(4 * WORLD)
        # (gloo's future holds the output's blocks, plait's the output: compare the values)
        case(out, "all_gather_into_tensor", lambda: torch.cat([v.reshape(-1) for v in fut(dist.all_gather_into_tensor(o, torch.arange(4.) + RANK, async_op=True))]))
        o = torch.zeros(2 * WORLD)
        case(out, "all_to_all_single", lambda: fut(dist.all_to_all_single(o, torch.arange(2. * WORLD) + 10 * RANK, async_op=True)))
        outs = [torch.zeros(2) for _ in range(WORLD)]
        case(out, "all_to_all", lambda: fut(dist.all_to_all(outs, [torch.full((2,), 10. * RANK + j) for j in range(WORLD)], async_op=True)))
        x = torch.arange(4.) + RANK
        # (off the root gloo leaves partial sums in the input; plait leaves it as it was)
        case(out, "reduce", lambda: (lambda v: v if RANK == root else "not the root")(fut(dist.reduce(x, root, async_op=True))))
        gl = [torch.zeros(4) for _ in range(WORLD)] if RANK == root else None
        case(out, "gather", lambda: fut(dist.gather(torch.arange(4.) + RANK, gl, root, async_op=True)))
        y = torch.zeros(4)
        sl = [torch.full((4,), float(r)) for r in range(WORLD)] if RANK == root else None
        case(out, "scatter", lambda: fut(dist.scatter(y, sl, root, async_op=True)))
        x = torch.arange(4.) + RANK
        case(out, "broadcast", lambda: fut(dist.broadcast(x, root, async_op=True)))
        y = torch.zeros(2)
        case(out, "reduce_scatter", lambda: fut(dist.reduce_scatter(y, [torch.full((2,), 1. + r) for r in range(WORLD)], async_op=True)))
        y = torch.zeros(2)
        case(out, "reduce_scatter_tensor", lambda: fut(dist.reduce_scatter_tensor(y, torch.arange(2. * WORLD), async_op=True)))
    dist.destroy_process_group()
    return out


def scenario_several_tensors(args):
    """gloo's older forms with several tensors per process, and its refusals."""
    init(args[1])
    pg, out = dist.group.WORLD, {}
    root = WORLD - 1

    def two(base):
        return [torch.full((3,), base + 10. * RANK), torch.full((3,), base + 1 + 10. * RANK)]

    for name, op in (("sum", R.SUM), ("max", R.MAX), ("min", R.MIN), ("product", R.PRODUCT)):
        ts = two(1)
        case(out, f"allreduce two tensors {name}", lambda: (pg.allreduce(ts, op=op).wait(), ts)[1])
    ints = [torch.tensor([1, 2, 4]) << RANK, torch.tensor([8, 16, 32]) << RANK]
    case(out, "allreduce two int tensors bor", lambda: (pg.allreduce(ints, op=R.BOR).wait(), ints)[1])
    for k in (0, 1):
        ts = two(0)
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = root, k
        case(out, f"broadcast two tensors rootTensor={k}", lambda: (pg.broadcast(ts, o).wait(), ts)[1])
    ins = two(5)
    lists = [[torch.zeros(3) for _ in range(2 * WORLD)] for _ in range(2)]
    case(out, "allgather two inputs", lambda: (pg.allgather(lists, ins).wait(), lists)[1])
    o = dist.ReduceOptions()
    o.rootRank, o.rootTensor = root, 1
    case(out, "reduce two tensors (refused)", lambda: pg.reduce(two(0), o).wait())
    o = dist.BroadcastOptions()
    o.rootRank, o.rootTensor = root, 2
    case(out, "broadcast rootTensor out of range (refused)", lambda: pg.broadcast(two(0), o).wait())
    case(out, "allreduce tensors of two shapes (refused)", lambda: pg.allreduce([torch.zeros(3), torch.zeros(4)]).wait())
    case(out, "still usable", lambda: (dist.all_reduce(x := torch.ones(2)), x)[1])
    dist.destroy_process_group()
    return out


def scenario_groups(args):
    """split_group, set_timeout and the backend's options, as torch exposes them."""
    backend = args[1]
    init(backend)
    out = {}
    cpu = torch.device("cpu")
    opts = dist.group.WORLD._get_backend(cpu).options
    out["options backend is the group's"] = opts.backend == backend
    # split_group: [[0, 1], [2, ...]], ranks in the order given
    splits = [[1, 0], list(range(2, WORLD))] if WORLD > 2 else [[1, 0]]
    sub = dist.split_group(split_ranks=splits)
    mine = next((s for s in splits if RANK in s), None)
    out["split member"] = sub is not None and sub is not dist.GroupMember.NON_GROUP_MEMBER
    if out["split member"]:
        out["split rank and size"] = (dist.get_rank(sub), dist.get_world_size(sub), mine.index(RANK), len(mine))
        x = torch.full((2,), 1. + RANK)
        dist.all_reduce(x, group=sub)
        out["split all_reduce"] = value(x)
        outs = [torch.zeros(1) for _ in mine]
        dist.all_gather(outs, torch.tensor([float(RANK)]), group=sub)
        out["split all_gather order"] = value(outs)
    dist.barrier()
    # set_timeout: a group whose default is cut to 2 s, and a member that never arrives
    g = dist.new_group(list(range(WORLD)))
    dist.set_timeout(datetime.timedelta(seconds=2), group=g)
    out["options follow set_timeout"] = g._get_backend(cpu).options._timeout == datetime.timedelta(seconds=2)
    t0 = time.monotonic()
    if RANK == WORLD - 1:
        time.sleep(6)  # never calls the all_reduce below
        out["missing rank"] = True
    else:
        try:
            dist.all_reduce(torch.ones(2), group=g)
            out["late peer"] = "completed"
        except Exception:
            elapsed = time.monotonic() - t0
            out["late peer raised within 5 s (the new 2 s timeout, not 60 s)"] = elapsed < 5
    # The timed-out group may not close cleanly on every backend: leave without closing.
    (Path(args[0]) / f"result{RANK}.pkl").write_bytes(pickle.dumps(out))
    os._exit(0)


def scenario_ddp_join(args):
    """DDP's join context with uneven inputs (rank r trains r more steps), dividing by the initial
    world size and by the ranks still training: the reducer holds the Work of each forward's
    all_reduce and waits on it in backward, after Python dropped it."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    init(args[1], seconds=30)
    out = {}
    for divide_by_initial in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with ddp.join(divide_by_initial_world_size=divide_by_initial):
            for step in range(2 + RANK):
                g = torch.Generator().manual_seed(100 * step + RANK)
                loss = ddp(torch.randn(4, 6, generator=g)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        out[f"parameters, divide_by_initial_world_size={divide_by_initial}"] = [
            round(float(p.detach().double().sum()), 6) for p in model.parameters()]
    dist.destroy_process_group()
    return out


def scenario_refusals(args):
    """plait only (gloo leaves the other ranks waiting here): a call one rank refuses fails on
    every rank at once, naming that rank and the reason, and the group goes on working."""
    init(args[1], seconds=30)
    out = {}

    def timed(name, fn):
        t0 = time.monotonic()
        try:
            fn()
            out[name] = ("completed", time.monotonic() - t0)
        except Exception as e:
            out[name] = (f"{type(e).__name__}: {e}", time.monotonic() - t0)

    def all_gather_own_slot_wrong():
        outs = [torch.zeros(4) for _ in range(WORLD)]
        if RANK == 0:
            outs[0] = torch.zeros(5)
        dist.all_gather(outs, torch.ones(4))

    timed("all_gather, rank 0's own slot wrong", all_gather_own_slot_wrong)
    timed("barrier after", dist.barrier)
    # Rank 1 is the root the others name: every other rank's part needs it, so every rank must
    # fail (a root that refused nothing could complete its part).
    timed("broadcast, rank 1's root out of range",
          lambda: dist.group.WORLD.broadcast(torch.ones(2), root=WORLD + 3 if RANK == 1 else 1).wait())
    timed("int all_reduce, rank 2 asks for AVG",
          lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=R.AVG if RANK == 2 else R.SUM))
    timed("the same refusal on every rank", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=R.AVG))

    def async_reduce_scatter():
        ins = [torch.ones(3) for _ in range(WORLD if RANK != 0 else WORLD - 1)]
        dist.reduce_scatter(torch.zeros(3), ins, async_op=True).wait()

    timed("async reduce_scatter, rank 0 one input short", async_reduce_scatter)
    sub = dist.new_group([1, 2])
    if RANK in (1, 2):
        timed("subgroup all_gather_into_tensor, rank 2 wrong size", lambda: dist.all_gather_into_tensor(
            torch.zeros(2 * 2 + (1 if RANK == 2 else 0)), torch.ones(2), group=sub))
    x = torch.full((3,), 1.0 + RANK)
    timed("all_reduce after", lambda: dist.all_reduce(x))
    out["all_reduce after value"] = x.tolist()
    dist.destroy_process_group()
    return out


def main():
    name, out = sys.argv[1], Path(sys.argv[2])
    args = [str(out)] + sys.argv[3:]
    result = globals()[f"scenario_{name}"](args)
    (out / f"result{RANK}.pkl").write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    main()
