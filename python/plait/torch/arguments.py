"""The arguments of c10d calls: their options objects, and the checks that refuse a bad call before
anything is sent (each raises `staging.invalid`: a ValueError and a RuntimeError)."""

import datetime

import torch
import torch.distributed as dist

from . import staging as stg
from .staging import invalid

_R = dist.ReduceOp.RedOpType if hasattr(dist.ReduceOp, "RedOpType") else dist.ReduceOp
OPS = {
    _R.SUM: "sum",
    _R.AVG: "avg",
    _R.PRODUCT: "prod",
    _R.MIN: "min",
    _R.MAX: "max",
    _R.BAND: "band",
    _R.BOR: "bor",
    _R.BXOR: "bxor",
}
if hasattr(_R, "PREMUL_SUM"):
    OPS[_R.PREMUL_SUM] = "premul_sum"


AllgatherOptions = getattr(dist, "AllgatherOptions", None) or getattr(torch._C._distributed_c10d, "AllgatherOptions", None)
if AllgatherOptions is None:  # pragma: no cover - very old torch

    class AllgatherOptions:
        """Stand-in for torch's AllgatherOptions."""

        timeout = datetime.timedelta(milliseconds=-1)
        asyncOp = True


# The convenience overloads' parameters (`allreduce(tensor, op=..., timeout=...)`,
# `broadcast(tensor, root, timeout=None)`...) and the options field each one sets.
_FIELDS = {"root": "rootRank", "op": "reduceOp", "timeout": "timeout"}


def options(opts, cls, rest, kw, what, *fields):
    """The options object of a call, however c10d's Python API let the caller write it: torch's
    Options (positional or `opts=`), or the convenience overload's arguments after the tensors,
    positional or by keyword (`fields`: their names in order, before `timeout`), as gloo takes
    them: `pg.broadcast(t, root=0)`, `pg.allreduce(t, op=ReduceOp.MAX)`, `pg.barrier(timeout)`."""
    if "opts" in kw:
        if opts is not None:
            raise TypeError(f"{what}() got multiple values for argument 'opts'")
        opts = kw.pop("opts")
    if opts is not None and hasattr(opts, "timeout") and not isinstance(opts, datetime.timedelta):
        if rest or kw:
            raise TypeError(f"{what}() takes an options object or the separate arguments {', '.join(fields + ('timeout',))}, not both")
        return opts
    names = fields + ("timeout",)
    args = ([opts] if opts is not None else []) + list(rest)
    if len(args) > len(names):
        raise TypeError(f"{what}() takes at most {len(names)} arguments after the tensors ({', '.join(names)}), got {len(args)}")
    given = dict(zip(names, args))
    for name, val in kw.items():
        if name not in names:
            raise TypeError(f"{what}() got an unexpected keyword argument {name!r}")
        if name in given:
            raise TypeError(f"{what}() got multiple values for argument {name!r}")
        given[name] = val
    o = cls()
    for name, val in given.items():
        if val is None:
            continue
        if name == "op" and not isinstance(val, dist.ReduceOp):
            val = dist.ReduceOp(val)
        setattr(o, _FIELDS[name], val)
    return o


def reduce_op(op):
    """(core op name, factor) of a torch ReduceOp."""
    name = OPS.get(getattr(op, "op", op))
    if name is None:
        raise invalid(f"unsupported reduce op {op}")
    factor = None
    if name == "premul_sum":
        f = getattr(op, "factor", None)
        if f is None:
            raise invalid("PREMUL_SUM needs a factor (make it with torch.distributed._make_nccl_premul_sum)")
        if isinstance(f, torch.Tensor):
            f = f.detach().to("cpu").reshape(-1)[0].item()
        factor = float(f)
    return name, factor


def one_tensor(tensors, what):
    """The single tensor of a call that takes one per process (alone or in a list of one)."""
    if not isinstance(tensors, (list, tuple)):
        return stg.check_tensor(tensors, what)
    if len(tensors) != 1:
        raise invalid(f"{what}: expected one tensor per process, got a list of {len(tensors)}")
    return stg.check_tensor(tensors[0], what)


def same_kind(ts, ref, what):
    """Every tensor of `ts` is a tensor with `ref`'s dtype on `ref`'s device type."""
    for t in ts:
        stg.check_tensor(t, what)
        if t.dtype != ref.dtype:
            raise invalid(f"{what}: tensors of different dtypes in one call ({t.dtype} and {ref.dtype})")
        if t.device.type != ref.device.type:
            raise invalid(f"{what}: tensors on different devices in one call ({t.device} and {ref.device})")


def group_rank(g, r, what):
    if not isinstance(r, int) or r < 0 or r >= g.size:
        raise invalid(f"{what}: rank {r} is out of range for a group of {g.size}")
    return r


def peer_rank(g, r, what, itself):
    """A point-to-point peer: a rank of the group other than this one."""
    if group_rank(g, r, what) == g.rank:
        raise invalid(f"{what}: a rank cannot {itself}")
    return r


def one_per_rank(g, ts, ref, what, which, role, index=None, count_note="(the group size)"):
    """`ts` holds one tensor per rank, of `ref`'s kind, and tensor `index` (default: this rank's)
    has `ref`'s size. `which`: "output tensor"/"input tensor"; `role`: what `ref` is."""
    index = g.rank if index is None else index
    if len(ts) != g.size:
        raise invalid(f"{what}: expected {g.size} {which}s {count_note}, got {len(ts)}")
    same_kind(ts, ref, what)
    if ts[index].numel() != ref.numel():
        raise invalid(f"{what}: {which} {index} has {ts[index].numel()} elements, the {role} {ref.numel()}")


def root_list(g, arg, flat, ref, root, what, side):
    """The list of one tensor per rank that only the root of a gather (`side` "output") or scatter
    ("input") passes, like `ref`: checked at the root, refused elsewhere, [] off the root. `arg`
    is the list itself (`flat`, torch's single-list overload) or a list holding it."""
    lists = ([list(arg)] if arg else []) if flat else [list(x) for x in arg]
    if g.rank != root:
        if lists and any(len(x) for x in lists):
            raise invalid(f"{what}: only the root may pass {side} tensors")
        return []
    if len(lists) != 1:
        raise invalid(f"{what}: the root needs exactly one {side} list")
    role = "input" if side == "output" else "output"
    one_per_rank(g, lists[0], ref, what, f"{side} tensor", role, root, "at the root")
    return lists[0]


def blocks_of(g, outputs, inputs, what, whole):
    """(output, input) pairs where the `whole` one ("output": allgather into a tensor; "input":
    reduce_scatter of a tensor) holds group-size times the other's elements."""
    if len(outputs) != len(inputs):
        raise invalid(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
    block = "input" if whole == "output" else "output"
    for o, i in zip(outputs, inputs):
        stg.check_tensor(o, what)
        stg.check_tensor(i, what)
        same_kind([o], i, what)
        w, b = (o, i) if whole == "output" else (i, o)
        if w.numel() != g.size * b.numel():
            raise invalid(f"{what}: the {whole} must have world_size ({g.size}) times the {block}'s elements, "
                          f"got {w.numel()} for {b.numel()}")


def split_counts(splits, t, n, dt, what):
    """Core element counts per rank of an all_to_all_single tensor (None: equal splits)."""
    if t.dim() == 0:
        raise invalid(f"all_to_all_single: the {what} must have at least one dimension")
    rows = t.shape[0]
    per_row = (stg.elems(t, dt) // rows) if rows else 0
    if not splits:
        if rows % n:
            raise invalid(f"all_to_all_single: the {what}'s first dimension ({rows}) is not divisible by the group size {n}")
        return None
    if len(splits) != n:
        raise invalid(f"all_to_all_single: {what} split sizes must have {n} entries, got {len(splits)}")
    if sum(splits) != rows or any(s < 0 for s in splits):
        raise invalid(f"all_to_all_single: {what} split sizes {splits} do not add up to its first dimension {rows}")
    return [int(s) * per_row for s in splits]


def same_shape(ts, what):
    """The tensors of gloo's several-per-process forms: one dtype, device and shape."""
    for t in ts:
        stg.check_tensor(t, what)
    ref = ts[0]
    same_kind(ts, ref, what)
    for t in ts:
        if t.shape != ref.shape:
            raise invalid(f"{what}: the tensors of one call must have one shape, got {tuple(ref.shape)} and {tuple(t.shape)}")


def root_tensor(opts, count, what):
    """The index of the root's tensor (`opts.rootTensor`) among `count` tensors per process."""
    k = getattr(opts, "rootTensor", 0)
    if not isinstance(k, int) or not 0 <= k < count:
        raise invalid(f"{what}: rootTensor {k} is out of range for {count} tensor(s) per process")
    return k


_LOCAL = {
    "sum": lambda a, b: a.add_(b),
    "avg": lambda a, b: a.add_(b),
    "premul_sum": lambda a, b: a.add_(b),
    "prod": lambda a, b: a.mul_(b),
    "min": lambda a, b: torch.minimum(a, b, out=a),
    "max": lambda a, b: torch.maximum(a, b, out=a),
    "band": lambda a, b: a.bitwise_and_(b),
    "bor": lambda a, b: a.bitwise_or_(b),
    "bxor": lambda a, b: a.bitwise_xor_(b),
}


def reduce_locally(ts, op):
    """A new tensor holding the reduction of `ts` (one shape) with `op`, such that reducing it
    across the ranks with `op` gives the reduction of every rank's tensors: `avg` takes the mean
    here (every rank has as many tensors); `premul_sum` sums here, the factor applies once."""
    acc = ts[0].detach().clone(memory_format=torch.contiguous_format)
    for t in ts[1:]:
        _LOCAL[op](acc, t.detach())
    if op == "avg":
        acc.div_(len(ts))
    return acc
