"""The two allreduce cases that do not take `engine.issue`'s path: the small blocking call, in as
few steps as possible, and the sparse one, which runs to completion."""

import math

import torch
import torch.distributed as dist

from .. import _core
from .._core import PlaitError
from . import staging as stg
from . import trace
from .arguments import OPS, reduce_op
from .engine import Op, profiling
from .staging import invalid
from .work import completed_work, done_work, torch_error

# What the small-allreduce path handles; anything else takes the general path.
_SMALL_DTYPES = {dt: name for dt, name in stg.CORE_DTYPE.items() if name != "bool"}
_SMALL_OPS = {op: name for op, name in OPS.items() if name in ("sum", "avg", "min", "max", "prod")}
_FLOATS = frozenset(d["name"] for d in _core.DTYPES if d["float"])


def small_allreduce(g, t, opts):
    """The common small blocking call (one dense contiguous CPU tensor, a plain op, no compression
    or staging): on a machine whose cores every rank shares, this Python is a good part of a small
    allreduce's cost. None: not that case, take the general path (which gives the same result)."""
    if (g.closed or type(opts) is not dist.AllreduceOptions or opts.asyncOp is not False
            or not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type != "cpu"
            or not t.is_contiguous() or g.opts.force_staging or g.opts.inline == "never"):
        return None
    dt = _SMALL_DTYPES.get(t.dtype)
    op = _SMALL_OPS.get(getattr(opts.reduceOp, "op", None))
    if dt is None or op is None or (op == "avg" and dt not in _FLOATS):
        return None
    nbytes = t.numel() * t.element_size()
    if nbytes > g.opts.inline_bytes or not g.idle() or profiling():
        return None
    if dt == "f32":
        if g.wire_name is not None:
            return None
        wire = "native"  # the group's choice is explicit: PLAIT_WIRE_DTYPE never applies
    elif dt == "f64" and g.wire is not None:
        return None
    else:
        wire = None
    p = t.data_ptr() if nbytes else 0
    ts = (t,)
    rec = g.trace.begin("all_reduce", opts, ts, ts) if g.trace is not None else None
    started = False
    try:
        if g.check is not None:
            g.check.run("all_reduce", opts, ts, ts)  # TORCH_DISTRIBUTED_DEBUG=DETAIL: raises on every rank
        w = g.comm.collective("allreduce", p, nbytes, p, nbytes, dt, op, timeout=g.op_timeout(opts.timeout), inline=True,
                              wire=wire)
        started = True
        if rec is not None:
            trace.running(rec)
        w.wait()  # inline: complete already; raises the operation's error
    except PlaitError as e:
        err = torch_error(e, g.context())
        err.plait_started = started  # an error of the run itself is not this rank's refusal (`agreed`)
        if rec is not None:
            trace.end(rec, err)
        raise err from None
    if rec is not None:
        trace.done(rec)
    return done_work(g, [t], "all_reduce")


def sparse_allreduce(g, t, opts):
    """SUM of sparse COO tensors (what DDP does with sparse gradients): every rank gathers the
    others' indices and values and adds them up locally; the result replaces `t`'s contents.
    Runs to completion before returning."""
    op, _ = reduce_op(opts.reduceOp)
    if op != "sum":
        raise invalid(f"all_reduce: sparse tensors support SUM only, got {op}")
    timeout = g.op_timeout(opts.timeout)

    def gather(send, recv, dtype, counts=None):
        try:
            g.start(Op("allgather", send, recv, dtype, recv_counts=counts), timeout, inline=True).wait()
        except PlaitError as e:
            raise torch_error(e, g.context()) from None

    x = t.detach().coalesce()
    if not stg.strategy(x.device.type).direct:  # CUDA/MPS: the core needs host memory
        x = x.cpu()
    idx = x.indices().t().contiguous()  # nnz x sparse_dim
    val = x.values().contiguous()  # nnz x dense dims
    all_nnz = torch.zeros(g.size, dtype=torch.int64)
    gather(torch.tensor([idx.shape[0]], dtype=torch.int64), all_nnz, "i64")
    counts = [int(c) for c in all_nnz]
    sd = idx.shape[1]
    all_idx = torch.zeros(sum(counts), sd, dtype=torch.int64)
    gather(idx, all_idx, "i64", [c * sd for c in counts])
    v = stg.real_view(val, None, "all_reduce")
    dt = stg.move_dtype(v.dtype)
    per = math.prod(v.shape[1:]) * (v.element_size() if dt == "u8" and v.dtype != torch.uint8 else 1)  # per row
    all_val = torch.zeros((sum(counts),) + tuple(val.shape[1:]), dtype=val.dtype)
    gather(v, stg.real_view(all_val, None, "all_reduce"), dt, [c * per for c in counts])
    out = torch.sparse_coo_tensor(all_idx.t(), all_val, t.shape).coalesce()
    with torch.no_grad():
        t.copy_(out)
    return completed_work(g, [t], "all_reduce")
