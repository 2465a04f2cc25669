"""The torch.distributed backend "plait": a ProcessGroup whose collectives run on plait's core.

Layout: `_Group` holds one core communicator (its own links), the staging pool, the completion
thread and the point-to-point lanes. `_Methods` maps every c10d method (old and new names) onto
core calls. `PlaitProcessGroup` (a `dist.ProcessGroup` subclass, torch 2.5+) and `PlaitBackend`
(a `c10d.Backend` subclass, used for a device of a mixed "cpu:plait,cuda:nccl" group on torch
versions whose C++ calls Python overrides of Backend) are thin shells over the two.
"""

import collections
import datetime
import os
import sys
import threading
import weakref

import torch
import torch.distributed as dist

from .. import _core
from .._core import PlaitError
from . import staging as stg
from .lanes import Lanes
from .options import from_pg_options
from .staging import HostPool, Staged, invalid
from .work import Completer, PlaitWork, completed_work, seconds, torch_error

_R = dist.ReduceOp.RedOpType if hasattr(dist.ReduceOp, "RedOpType") else dist.ReduceOp
_OPS = {
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
    _OPS[_R.PREMUL_SUM] = "premul_sum"

# What the small-allreduce path handles; anything else takes the general path.
_SMALL_DTYPES = {dt: name for dt, name in stg.CORE_DTYPE.items() if name != "bool"}
_SMALL_OPS = {op: name for op, name in _OPS.items() if name in ("sum", "avg", "min", "max", "prod")}
_FLOATS = frozenset({"f16", "bf16", "f32", "f64"})

_TAG_MASK = (1 << 64) - 1
_GROUPS = weakref.WeakSet()  # live groups, so that interpreter exit can close them


class _Group:
    """The engine of one c10d group (one device's backend)."""

    def __init__(self, comm, opts, group_id, global_ranks):
        self.comm = comm
        self.opts = opts
        self.rank = comm.rank
        self.size = comm.size
        self.group_id = group_id
        self.global_ranks = list(global_ranks) if global_ranks else list(range(comm.size))
        tag = f"g{group_id}-r{comm.rank}"
        self.completer = Completer(tag)
        self.lanes = Lanes(tag)
        self.pool = HostPool(opts.staging_cache_bytes)
        self._inflight = collections.deque()
        self._lock = threading.Lock()
        self.closed = False
        self.store = None
        self.mb_seq = 0
        self.coalescing = None  # works issued between startCoalescing and endCoalescing
        self.owner = None  # weakref to the torch-facing object (for profiler labels)
        # float32 allreduce goes through the core's codec (each contribution encoded once, results
        # bit-identical on every rank); other float reductions are cast to `wire` here (no int8).
        self.wire_name = opts.wire_dtype
        self.wire = stg.WIRE_DTYPE.get(opts.wire_dtype)
        _GROUPS.add(self)

    # -- helpers -------------------------------------------------------------------------------

    def staged(self):
        return Staged(self.pool, self.opts.force_staging)

    def context(self):
        """Where an error happened, for its message."""
        ctx = f"process group {self.group_id!r}, rank {self.rank} of {self.size}"
        if self.global_ranks != list(range(self.size)):
            ctx += f"; the group's ranks 0..{self.size - 1} are global ranks {self.global_ranks}"
        return ctx

    def idle(self):
        q = self._inflight
        while q and q[0].is_completed():
            q.popleft()
        return not q

    def inline_ok(self, opts, nbytes):
        """Whether a call may run on the caller's thread: it must be blocking (torch says so in
        opts.asyncOp), small enough, and nothing else of this group may be in flight."""
        mode = self.opts.inline
        if mode == "never" or _profiling():
            return False
        if getattr(opts, "asyncOp", True) is not False:
            return False
        if mode == "auto" and nbytes > self.opts.inline_bytes:
            return False
        return self.idle()

    def coll(self, coll, send, recv, dtype, op="sum", *, factor=None, root=0, send_counts=None, recv_counts=None, timeout=None, inline=False,
             wire=None):
        """Starts one core collective on host tensors `send`/`recv` (None: nothing)."""
        sp, sn = (send.data_ptr(), stg.nbytes(send)) if send is not None else (0, 0)
        rp, rn = (recv.data_ptr(), stg.nbytes(recv)) if recv is not None else (0, 0)
        if sn == 0:
            sp = 0
        if rn == 0:
            rp = 0
        w = self.comm.collective(
            coll, sp, sn, rp, rn, dtype, op, factor=factor, root=root, send_counts=send_counts,
            recv_counts=recv_counts, timeout=timeout, inline=inline, wire=wire,
        )
        if not inline:
            self._inflight.append(w)
        return w

    def work(self, parts, outputs, st, what, inputs=()):
        fin = st.finish if st is not None else None
        w = PlaitWork(self, parts, outputs, fin, what)
        if _profiling():
            _profile(self, w, what, inputs)
        if self.coalescing is not None:
            self.coalescing.append(w)
        return w

    def shutdown(self, abort_reason=None):
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            if abort_reason is not None:
                self.comm.abort(abort_reason)
            self.comm.close()
        finally:
            self.lanes.stop()
            self.completer.stop()
            self.pool.clear()
            _GROUPS.discard(self)


_PROF_NAMES = {
    "all_to_all_single": "all_to_all",
    "recv from any rank": "recvAnySource",
}


def _profiling():
    try:
        return torch._C._autograd._profiler_enabled()
    except Exception:  # pragma: no cover
        return False


def _profile(g, w, what, inputs):
    """An async profiler event "<backend>:<op>" (what torch's own backends record), ending when
    the op completes (on the completion thread)."""
    try:
        label = "plait"
        pg = g.owner() if g.owner is not None else None
        if pg is not None:
            entry = dist.distributed_c10d._world.pg_map.get(pg)
            if entry:
                label = str(entry[0])
        name = _PROF_NAMES.get(what) or what.split(" ")[0]
        h = torch._C._autograd._record_function_with_args_enter(f"{label}:{name}", *[t for t in inputs if isinstance(t, torch.Tensor)])
        fut = torch.futures.Future()
        torch.ops.profiler._call_end_callbacks_on_jit_fut(h, fut)
        w._end_on_thread(fut)
    except Exception:  # profiling must never break an op
        pass


def _timeout(opts):
    t = getattr(opts, "timeout", None)
    return seconds(t)


def _opname(reduce_op):
    """(core op name, factor) of a torch ReduceOp."""
    rt = getattr(reduce_op, "op", reduce_op)
    name = _OPS.get(rt)
    if name is None:
        raise invalid(f"unsupported reduce op {reduce_op}")
    factor = None
    if name == "premul_sum":
        f = getattr(reduce_op, "factor", None)
        if f is None:
            raise invalid("PREMUL_SUM needs a factor (make it with torch.distributed._make_nccl_premul_sum)")
        if isinstance(f, torch.Tensor):
            f = f.detach().to("cpu").reshape(-1)[0].item()
        factor = float(f)
    return name, factor


def _one(tensors, what):
    if not isinstance(tensors, (list, tuple)):
        return stg.check_tensor(tensors, what)
    if len(tensors) != 1:
        raise invalid(f"{what}: expected one tensor per process, got a list of {len(tensors)}")
    return stg.check_tensor(tensors[0], what)


def _same(ts, ref, what):
    for t in ts:
        stg.check_tensor(t, what)
        if t.dtype != ref.dtype:
            raise invalid(f"{what}: tensors of different dtypes in one call ({t.dtype} and {ref.dtype})")
        if t.device.type != ref.device.type:
            raise invalid(f"{what}: tensors on different devices in one call ({t.device} and {ref.device})")


def _rank_check(g, r, what):
    if not isinstance(r, int) or r < 0 or r >= g.size:
        raise invalid(f"{what}: rank {r} is out of range for a group of {g.size}")
    return r


def _call(fn, g=None):
    """Runs a core call, converting plait errors to their torch-facing form."""
    try:
        return fn()
    except PlaitError as e:
        raise torch_error(e, g.context() if g is not None else None) from None


class _Methods:
    """c10d's ProcessGroup/Backend interface over `self._g` (a `_Group`)."""

    # -- identity ------------------------------------------------------------------------------

    def getBackendName(self):
        return "plait"

    def _get_backend_name(self):
        return "plait"

    def getRank(self):
        return self._g.rank

    def getSize(self):
        return self._g.size

    def getGroupName(self):
        return self._pl_name

    def setGroupName(self, name):
        self._pl_name = name

    def getGroupDesc(self):
        return self._pl_desc

    def setGroupDesc(self, desc):
        self._pl_desc = desc

    @property
    def plait_comm(self):
        """The core communicator (for `routes()`, `algorithm_for()`...)."""
        return self._g.comm

    def __repr__(self):
        return f"<plait ProcessGroup {self._pl_name!r} rank {self._g.rank} of {self._g.size}>"

    # -- lifecycle -----------------------------------------------------------------------------

    def shutdown(self):
        self._g.shutdown()

    def abort(self):
        self._g.shutdown(abort_reason="abort() called on the process group")

    def _pl_tensor_work(self, fn):
        g = self._g
        if g.closed:
            raise torch_error(_core.BrokenError(f"plait: process group {self._pl_name!r} was shut down"))
        return fn()

    # -- allreduce -----------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None, *rest):
        if not rest and type(tensors) is list and len(tensors) == 1:
            w = self._pl_small_allreduce(tensors[0], opts)
            if w is not None:
                return w
        opts = _opts(opts, dist.AllreduceOptions, rest, "reduceOp")
        if isinstance(tensors, (list, tuple)) and len(tensors) == 1 and getattr(tensors[0], "layout", None) == torch.sparse_coo:
            return self._pl_tensor_work(lambda: self._pl_sparse_allreduce(tensors[0], opts))
        t = _one(tensors, "all_reduce")
        return self._pl_tensor_work(lambda: self._pl_allreduce([t], opts, "all_reduce"))

    def _pl_small_allreduce(self, t, opts):
        """The common small blocking call (one dense contiguous CPU tensor, a plain op, no
        compression or staging) in as few steps as possible: on a machine whose cores every
        rank shares, this Python is a good part of a small allreduce's cost. None: not that
        case, take the general path (which gives the same result)."""
        g = self._g
        if (g.closed or type(opts) is not dist.AllreduceOptions or opts.asyncOp is not False
                or not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type != "cpu"
                or not t.is_contiguous() or g.opts.force_staging or g.opts.inline == "never"):
            return None
        dt = _SMALL_DTYPES.get(t.dtype)
        opname = _SMALL_OPS.get(getattr(opts.reduceOp, "op", None))
        if dt is None or opname is None or (opname == "avg" and dt not in _FLOATS):
            return None
        nbytes = t.numel() * t.element_size()
        if nbytes > g.opts.inline_bytes or not g.idle() or _profiling():
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
        w = _call(lambda: g.comm.collective("allreduce", p, nbytes, p, nbytes, dt, opname, timeout=_timeout(opts),
                                            inline=True, wire=wire), g)
        return g.work([w], [t], None, "all_reduce", (t,))

    def _pl_sparse_allreduce(self, t, opts):
        """SUM of sparse COO tensors (what DDP does with sparse gradients): every rank gathers the
        others' indices and values and adds them up locally; the result replaces `t`'s contents.
        Runs to completion before returning."""
        g = self._g
        opname, _ = _opname(opts.reduceOp)
        if opname != "sum":
            raise invalid(f"all_reduce: sparse tensors support SUM only, got {opname}")
        timeout = _timeout(opts)
        x = t.detach().coalesce()
        if not stg.strategy(x.device.type).direct:  # CUDA/MPS: the core needs host memory
            x = x.cpu()
        idx = x.indices().t().contiguous()  # nnz x sparse_dim
        val = x.values().contiguous()  # nnz x dense dims
        n = g.size
        nnz = torch.tensor([idx.shape[0]], dtype=torch.int64)
        all_nnz = torch.zeros(n, dtype=torch.int64)
        _call(lambda: g.coll("allgather", nnz, all_nnz, "i64", timeout=timeout, inline=True), g).wait()
        counts = [int(c) for c in all_nnz]
        sd = idx.shape[1]
        all_idx = torch.zeros(sum(counts), sd, dtype=torch.int64)
        _call(lambda: g.coll("allgather", idx, all_idx, "i64", recv_counts=[c * sd for c in counts], timeout=timeout, inline=True), g).wait()
        v = stg.real_view(val, None, "all_reduce")
        dt = stg.move_dtype(v.dtype)
        per = 1  # core elements per row of values
        for d in v.shape[1:]:
            per *= d
        if dt == "u8" and v.dtype != torch.uint8:
            per *= v.element_size()
        all_val = torch.zeros((sum(counts),) + tuple(val.shape[1:]), dtype=val.dtype)
        av = stg.real_view(all_val, None, "all_reduce")
        _call(lambda: g.coll("allgather", v, av, dt, recv_counts=[c * per for c in counts], timeout=timeout, inline=True), g).wait()
        out = torch.sparse_coo_tensor(all_idx.t(), all_val, t.shape).coalesce()
        with torch.no_grad():
            t.copy_(out)
        return completed_work(g, [t], "all_reduce")

    def allreduce_coalesced(self, tensors, opts=None):
        opts = _opts(opts, getattr(dist, "AllreduceCoalescedOptions", dist.AllreduceOptions), (), "reduceOp")
        ts = list(tensors)
        for t in ts:
            stg.check_tensor(t, "all_reduce_coalesced")
        return self._pl_tensor_work(lambda: self._pl_allreduce(ts, opts, "all_reduce_coalesced"))

    def _pl_allreduce(self, ts, opts, what):
        g = self._g
        opname, factor = _opname(opts.reduceOp)
        st = g.staged()
        outputs = list(ts)
        # Group by (dtype, device), in first-appearance order (the same on every rank).
        groups = collections.OrderedDict()
        for t in ts:
            v = stg.real_view(t, opname, what)
            groups.setdefault((v.dtype, v.device.type), []).append(v)
        parts = []
        total = sum(stg.nbytes(t) for t in ts)
        inline = g.inline_ok(opts, total)
        timeout = _timeout(opts)
        try:
            for (dtype, _dev), vs in groups.items():
                core_wire = None
                if dtype == torch.float32:
                    # The group's choice is explicit, so the core's PLAIT_WIRE_DTYPE default never applies.
                    compress = g.wire_name is not None and opname in ("sum", "avg", "premul_sum")
                    core_wire = g.wire_name if compress else "native"
                wire = g.wire if dtype == torch.float64 and opname in ("sum", "avg", "premul_sum", "min", "max") else None
                if wire is not None:
                    h = _wire_buffer(st, vs, wire)
                    dt = stg.CORE_DTYPE[wire]
                else:
                    dt = stg.reduce_dtype(vs[0], opname, what)
                    h = st.host(vs[0], read=True, write=True) if len(vs) == 1 else st.flat(vs, read=True, write=True)
                parts.append(_call(lambda: g.coll("allreduce", h, h, dt, opname, factor=factor, timeout=timeout, inline=inline,
                                                  wire=core_wire), g))
        except BaseException:
            _abandon(parts, st)
            raise
        return g.work(parts, outputs, st, what, ts)

    # -- broadcast / reduce --------------------------------------------------------------------

    def broadcast(self, tensors, opts=None, *rest):
        opts = _opts(opts, dist.BroadcastOptions, rest, "rootRank")
        t = _one(tensors, "broadcast")
        g = self._g
        root = _rank_check(g, opts.rootRank, "broadcast")
        if getattr(opts, "rootTensor", 0) != 0:
            raise invalid("broadcast: rootTensor must be 0 (one tensor per process)")

        def go():
            st = g.staged()
            v = stg.real_view(t, None, "broadcast")
            dt = stg.move_dtype(v.dtype)
            h = st.host(v, read=g.rank == root, write=g.rank != root)
            inline = g.inline_ok(opts, stg.nbytes(t))
            try:
                w = _call(lambda: g.coll("broadcast", h if g.rank == root else None, h, dt, root=root, timeout=_timeout(opts), inline=inline), g)
            except BaseException:
                _abandon([], st)
                raise
            return g.work([w], [t], st, "broadcast", (t,))

        return self._pl_tensor_work(go)

    def reduce(self, tensors, opts=None, *rest):
        opts = _opts(opts, dist.ReduceOptions, rest, "rootRank", "reduceOp")
        t = _one(tensors, "reduce")
        g = self._g
        root = _rank_check(g, opts.rootRank, "reduce")
        opname, factor = _opname(opts.reduceOp)

        def go():
            st = g.staged()
            v = stg.real_view(t, opname, "reduce")
            dt = stg.reduce_dtype(v, opname, "reduce")
            h = st.host(v, read=True, write=False)
            out = None
            if g.rank == root:
                # The root's result goes to a separate buffer (its input is read while the
                # result is being built), then back into the tensor.
                out = st._tmp(v, tuple(v.shape), v.dtype)
                st.keep.append(out)
                st._add_back(v, out)
            inline = g.inline_ok(opts, stg.nbytes(t))
            try:
                w = _call(lambda: g.coll("reduce", h, out, dt, opname, factor=factor, root=root, timeout=_timeout(opts), inline=inline), g)
            except BaseException:
                _abandon([], st)
                raise
            return g.work([w], [t], st, "reduce", (t,))

        return self._pl_tensor_work(go)

    # -- allgather -----------------------------------------------------------------------------

    def allgather(self, output_tensors, input_tensors, opts=None, *rest):
        opts = _opts(opts, _AllgatherOptions, rest)
        g = self._g
        if isinstance(input_tensors, torch.Tensor):  # the (list, tensor) overload
            outs, inp = list(output_tensors), input_tensors
        else:
            inp = _one(input_tensors, "all_gather")
            if len(output_tensors) != 1:
                raise invalid(f"all_gather: expected one output list per process, got {len(output_tensors)}")
            outs = list(output_tensors[0])
        return self._pl_tensor_work(lambda: self._pl_allgather_list(outs, inp, opts, "all_gather"))

    def _pl_allgather_list(self, outs, inp, opts, what):
        g = self._g
        stg.check_tensor(inp, what)
        if len(outs) != g.size:
            raise invalid(f"{what}: expected {g.size} output tensors (the group size), got {len(outs)}")
        _same(outs, inp, what)
        if outs[g.rank].numel() != inp.numel():
            raise invalid(f"{what}: output tensor {g.rank} has {outs[g.rank].numel()} elements, the input {inp.numel()}")
        st = g.staged()
        vin = stg.real_view(inp, None, what)
        vouts = [stg.real_view(o, None, what) for o in outs]
        dt = stg.move_dtype(vin.dtype)
        hin = st.host(vin, read=True, write=False)
        hout = st.flat(vouts, read=False, write=True)
        counts = [stg.elems(o, dt) for o in vouts]
        inline = g.inline_ok(opts, stg.nbytes(hout))
        try:
            w = _call(lambda: g.coll("allgather", hin, hout, dt, recv_counts=counts, timeout=_timeout(opts), inline=inline), g)
        except BaseException:
            _abandon([], st)
            raise
        return g.work([w], outs, st, what, (inp,))

    def _allgather_base(self, output, input, opts=None):
        opts = _opts(opts, _AllgatherOptions, ())
        return self._pl_tensor_work(lambda: self._pl_allgather_base([output], [input], opts, "all_gather_into_tensor"))

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = _opts(opts, _AllgatherOptions, ())
        return self._pl_tensor_work(lambda: self._pl_allgather_base(list(outputs), list(inputs), opts, "all_gather_into_tensor_coalesced"))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][i] receives rank r's input_list[i]: one allgather of the inputs laid
        end to end."""
        opts = _opts(opts, _AllgatherOptions, ())
        g = self._g
        what = "all_gather_coalesced"
        ins = list(input_list)
        outs = [list(x) for x in output_lists]

        def go():
            if len(outs) != g.size:
                raise invalid(f"{what}: expected {g.size} output lists (one per rank), got {len(outs)}")
            if not ins:
                return completed_work(g, [], what)
            ref = ins[0]
            _same(ins, ref, what)
            for r, lst in enumerate(outs):
                if len(lst) != len(ins):
                    raise invalid(f"{what}: output list {r} has {len(lst)} tensors for {len(ins)} inputs")
                _same(lst, ref, what)
            for i, t in enumerate(ins):
                if outs[g.rank][i].numel() != t.numel():
                    raise invalid(f"{what}: output [{g.rank}][{i}] has {outs[g.rank][i].numel()} elements, input {i} has {t.numel()}")
            st = g.staged()
            vins = [stg.real_view(t, None, what) for t in ins]
            vouts = [stg.real_view(t, None, what) for lst in outs for t in lst]
            dt = stg.move_dtype(vins[0].dtype)
            hin = st.flat(vins, read=True, write=False)
            hout = st.flat(vouts, read=False, write=True)
            counts = [sum(stg.elems(stg.real_view(t, None, what), dt) for t in lst) for lst in outs]
            inline = g.inline_ok(opts, stg.nbytes(hout))
            try:
                w = _call(lambda: g.coll("allgather", hin, hout, dt, recv_counts=counts, timeout=_timeout(opts), inline=inline), g)
            except BaseException:
                _abandon([], st)
                raise
            return g.work([w], [t for lst in outs for t in lst], st, what, ins)

        return self._pl_tensor_work(go)

    def _pl_allgather_base(self, outputs, inputs, opts, what):
        g = self._g
        if len(outputs) != len(inputs):
            raise invalid(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        for o, i in zip(outputs, inputs):
            stg.check_tensor(o, what)
            stg.check_tensor(i, what)
            _same([o], i, what)
            if o.numel() != g.size * i.numel():
                raise invalid(f"{what}: the output must have world_size ({g.size}) times the input's elements, got {o.numel()} for {i.numel()}")
        st = g.staged()
        parts = []
        inline = g.inline_ok(opts, sum(stg.nbytes(o) for o in outputs))
        try:
            for o, i in zip(outputs, inputs):
                vo, vi = stg.real_view(o, None, what), stg.real_view(i, None, what)
                dt = stg.move_dtype(vi.dtype)
                ho = st.host(vo, read=False, write=True)
                hi = _in_place_or(st, vi, ho, g.rank)
                parts.append(_call(lambda: g.coll("allgather", hi, ho, dt, timeout=_timeout(opts), inline=inline), g))
        except BaseException:
            _abandon(parts, st)
            raise
        return g.work(parts, list(outputs), st, what, inputs)

    # -- gather / scatter ----------------------------------------------------------------------

    def gather(self, output_tensors, input_tensors, opts=None, *rest):
        opts = _opts(opts, dist.GatherOptions, rest, "rootRank")
        g = self._g
        if isinstance(input_tensors, torch.Tensor):  # (list, tensor, root) overload
            outs_l, inp = [list(output_tensors)] if output_tensors else [], input_tensors
        else:
            inp = _one(input_tensors, "gather")
            outs_l = [list(x) for x in output_tensors]
        root = _rank_check(g, opts.rootRank, "gather")

        def go():
            if g.rank == root:
                if len(outs_l) != 1:
                    raise invalid("gather: the root needs exactly one output list")
                outs = outs_l[0]
                if len(outs) != g.size:
                    raise invalid(f"gather: expected {g.size} output tensors at the root, got {len(outs)}")
                _same(outs, inp, "gather")
                if outs[root].numel() != inp.numel():
                    raise invalid(f"gather: output tensor {root} has {outs[root].numel()} elements, the input {inp.numel()}")
            else:
                if outs_l and any(len(x) for x in outs_l):
                    raise invalid("gather: only the root may pass output tensors")
                outs = []
            return self._pl_gather(outs, inp, root, opts, "gather", flat_out=None)

        return self._pl_tensor_work(go)

    def _pl_gather(self, outs, inp, root, opts, what, flat_out):
        g = self._g
        st = g.staged()
        vin = stg.real_view(inp, None, what)
        dt = stg.move_dtype(vin.dtype)
        hin = st.host(vin, read=True, write=False)
        hout, counts = None, None
        if g.rank == root:
            if flat_out is not None:
                vo = stg.real_view(flat_out, None, what)
                hout = st.host(vo, read=False, write=True)
                counts = None
            else:
                vouts = [stg.real_view(o, None, what) for o in outs]
                hout = st.flat(vouts, read=False, write=True)
                counts = [stg.elems(o, dt) for o in vouts]
        inline = g.inline_ok(opts, stg.nbytes(hout) if hout is not None else stg.nbytes(hin))
        try:
            w = _call(lambda: g.coll("gather", hin, hout, dt, root=root, recv_counts=counts, timeout=_timeout(opts), inline=inline), g)
        except BaseException:
            _abandon([], st)
            raise
        return g.work([w], list(outs) if flat_out is None else [flat_out], st, what, (inp,))

    def gather_into_tensor(self, output, input, opts=None):
        opts = _opts(opts, dist.GatherOptions, (), "rootRank")
        g = self._g
        root = _rank_check(g, opts.rootRank, "gather_into_tensor")

        def go():
            if g.rank == root:
                _same([output], input, "gather_into_tensor")
                if output.numel() != g.size * input.numel():
                    raise invalid(f"gather_into_tensor: the output must have world_size ({g.size}) times the input's elements")
                return self._pl_gather([], input, root, opts, "gather_into_tensor", flat_out=output)
            return self._pl_gather([], input, root, opts, "gather_into_tensor", flat_out=None)

        return self._pl_tensor_work(go)

    def gather_single(self, output, input, opts=None):
        return self.gather_into_tensor(output, input, opts)

    def scatter(self, output_tensors, input_tensors, opts=None, *rest):
        opts = _opts(opts, dist.ScatterOptions, rest, "rootRank")
        g = self._g
        if isinstance(output_tensors, torch.Tensor):  # (tensor, list, root) overload
            out = output_tensors
            ins_l = [list(input_tensors)] if input_tensors else []
        else:
            out = _one(output_tensors, "scatter")
            ins_l = [list(x) for x in input_tensors]
        root = _rank_check(g, opts.rootRank, "scatter")

        def go():
            st = g.staged()
            vout = stg.real_view(out, None, "scatter")
            dt = stg.move_dtype(vout.dtype)
            hin, counts = None, None
            if g.rank == root:
                if len(ins_l) != 1:
                    raise invalid("scatter: the root needs exactly one input list")
                ins = ins_l[0]
                if len(ins) != g.size:
                    raise invalid(f"scatter: expected {g.size} input tensors at the root, got {len(ins)}")
                _same(ins, out, "scatter")
                if ins[root].numel() != out.numel():
                    raise invalid(f"scatter: input tensor {root} has {ins[root].numel()} elements, the output {out.numel()}")
                vins = [stg.real_view(i, None, "scatter") for i in ins]
                hin = st.flat(vins, read=True, write=False)
                counts = [stg.elems(i, dt) for i in vins]
            elif ins_l and any(len(x) for x in ins_l):
                raise invalid("scatter: only the root may pass input tensors")
            hout = st.host(vout, read=False, write=True)
            inline = g.inline_ok(opts, stg.nbytes(hin) if hin is not None else stg.nbytes(hout))
            try:
                w = _call(lambda: g.coll("scatter", hin, hout, dt, root=root, send_counts=counts, timeout=_timeout(opts), inline=inline), g)
            except BaseException:
                _abandon([], st)
                raise
            return g.work([w], [out], st, "scatter", ins_l[0] if ins_l and g.rank == root else (out,))

        return self._pl_tensor_work(go)

    # -- reduce_scatter ------------------------------------------------------------------------

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, *rest):
        opts = _opts(opts, dist.ReduceScatterOptions, rest, "reduceOp")
        g = self._g
        if isinstance(output_tensors, torch.Tensor):  # (tensor, list, op) overload
            out, ins = output_tensors, list(input_tensors)
        else:
            out = _one(output_tensors, "reduce_scatter")
            if len(input_tensors) != 1:
                raise invalid(f"reduce_scatter: expected one input list per process, got {len(input_tensors)}")
            ins = list(input_tensors[0])
        opname, factor = _opname(opts.reduceOp)

        def go():
            if len(ins) != g.size:
                raise invalid(f"reduce_scatter: expected {g.size} input tensors (the group size), got {len(ins)}")
            _same(ins, out, "reduce_scatter")
            if ins[g.rank].numel() != out.numel():
                raise invalid(f"reduce_scatter: input tensor {g.rank} has {ins[g.rank].numel()} elements, the output {out.numel()}")
            st = g.staged()
            vout = stg.real_view(out, opname, "reduce_scatter")
            vins = [stg.real_view(i, opname, "reduce_scatter") for i in ins]
            wire = g.wire if vout.dtype in (torch.float32, torch.float64) and opname in ("sum", "avg", "premul_sum", "min", "max") else None
            if wire is not None:
                hin = _wire_buffer(st, vins, wire, write=False)
                hout = _wire_buffer(st, [vout], wire, read=False)
                dt = stg.CORE_DTYPE[wire]
            else:
                dt = stg.reduce_dtype(vout, opname, "reduce_scatter")
                hin = st.flat(vins, read=True, write=False)
                hout = st.host(vout, read=False, write=True)
            counts = [i.numel() for i in vins]
            inline = g.inline_ok(opts, stg.nbytes(hin))
            try:
                w = _call(lambda: g.coll("reduce_scatter", hin, hout, dt, opname, factor=factor, recv_counts=counts, timeout=_timeout(opts), inline=inline), g)
            except BaseException:
                _abandon([], st)
                raise
            return g.work([w], [out], st, "reduce_scatter", ins)

        return self._pl_tensor_work(go)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = _opts(opts, dist.ReduceScatterOptions, (), "reduceOp")
        return self._pl_tensor_work(lambda: self._pl_rs_base([output], [input], opts, "reduce_scatter_tensor"))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = _opts(opts, dist.ReduceScatterOptions, (), "reduceOp")
        return self._pl_tensor_work(lambda: self._pl_rs_base(list(outputs), list(inputs), opts, "reduce_scatter_tensor_coalesced"))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def _pl_rs_base(self, outputs, inputs, opts, what):
        g = self._g
        opname, factor = _opname(opts.reduceOp)
        if len(outputs) != len(inputs):
            raise invalid(f"{what}: {len(outputs)} outputs for {len(inputs)} inputs")
        for o, i in zip(outputs, inputs):
            stg.check_tensor(o, what)
            stg.check_tensor(i, what)
            _same([o], i, what)
            if i.numel() != g.size * o.numel():
                raise invalid(f"{what}: the input must have world_size ({g.size}) times the output's elements, got {i.numel()} for {o.numel()}")
        st = g.staged()
        parts = []
        inline = g.inline_ok(opts, sum(stg.nbytes(i) for i in inputs))
        try:
            for o, i in zip(outputs, inputs):
                vo, vi = stg.real_view(o, opname, what), stg.real_view(i, opname, what)
                wire = g.wire if vo.dtype in (torch.float32, torch.float64) and opname in ("sum", "avg", "premul_sum", "min", "max") else None
                if wire is not None:
                    hi = _wire_buffer(st, [vi], wire, write=False)
                    ho = _wire_buffer(st, [vo], wire, read=False)
                    dt = stg.CORE_DTYPE[wire]
                else:
                    dt = stg.reduce_dtype(vo, opname, what)
                    hi = st.host(vi, read=True, write=False)
                    ho = st.host(vo, read=False, write=True)
                parts.append(_call(lambda: g.coll("reduce_scatter", hi, ho, dt, opname, factor=factor, timeout=_timeout(opts), inline=inline), g))
        except BaseException:
            _abandon(parts, st)
            raise
        return g.work(parts, list(outputs), st, what, inputs)

    # -- alltoall ------------------------------------------------------------------------------

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None, *rest):
        opts = _opts(opts, dist.AllToAllOptions, rest)
        g = self._g

        def go():
            stg.check_tensor(output, "all_to_all_single")
            stg.check_tensor(input, "all_to_all_single")
            _same([output], input, "all_to_all_single")
            st = g.staged()
            vo, vi = stg.real_view(output, None, "all_to_all_single"), stg.real_view(input, None, "all_to_all_single")
            dt = stg.move_dtype(vi.dtype)
            send_counts = _split_counts(list(input_split_sizes), vi, g.size, dt, "input")
            recv_counts = _split_counts(list(output_split_sizes), vo, g.size, dt, "output")
            hi = st.host(vi, read=True, write=False)
            ho = st.host(vo, read=False, write=True)
            if ho is hi or (stg.nbytes(hi) and hi.data_ptr() == ho.data_ptr()):
                hi = hi.clone()  # the core needs distinct buffers
                st.keep.append(hi)
            inline = g.inline_ok(opts, stg.nbytes(hi))
            try:
                w = _call(lambda: g.coll("alltoall", hi, ho, dt, send_counts=send_counts, recv_counts=recv_counts, timeout=_timeout(opts), inline=inline), g)
            except BaseException:
                _abandon([], st)
                raise
            return g.work([w], [output], st, "all_to_all_single", (input,))

        return self._pl_tensor_work(go)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None, *rest):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts, *rest)

    def alltoall(self, output_tensors, input_tensors, opts=None, *rest):
        opts = _opts(opts, dist.AllToAllOptions, rest)
        g = self._g
        outs, ins = list(output_tensors), list(input_tensors)

        def go():
            if len(outs) != g.size or len(ins) != g.size:
                raise invalid(f"all_to_all: expected {g.size} input and output tensors, got {len(ins)} and {len(outs)}")
            _same(outs + ins, ins[0], "all_to_all")
            st = g.staged()
            vins = [stg.real_view(t, None, "all_to_all") for t in ins]
            vouts = [stg.real_view(t, None, "all_to_all") for t in outs]
            dt = stg.move_dtype(vins[0].dtype)
            hi = st.flat(vins, read=True, write=False)
            ho = st.flat(vouts, read=False, write=True)
            if stg.nbytes(hi) and stg.nbytes(ho) and hi.data_ptr() < ho.data_ptr() + stg.nbytes(ho) and ho.data_ptr() < hi.data_ptr() + stg.nbytes(hi):
                hi = hi.clone()
                st.keep.append(hi)
            sc = [stg.elems(t, dt) for t in vins]
            rc = [stg.elems(t, dt) for t in vouts]
            inline = g.inline_ok(opts, stg.nbytes(hi))
            try:
                w = _call(lambda: g.coll("alltoall", hi, ho, dt, send_counts=sc, recv_counts=rc, timeout=_timeout(opts), inline=inline), g)
            except BaseException:
                _abandon([], st)
                raise
            return g.work([w], outs, st, "all_to_all", ins)

        return self._pl_tensor_work(go)

    # -- barrier -------------------------------------------------------------------------------

    def barrier(self, opts=None, *rest):
        opts = _opts(opts, dist.BarrierOptions, rest)
        g = self._g

        def go():
            inline = g.inline_ok(opts, 0)
            w = _call(lambda: g.comm.barrier(timeout=_timeout(opts), inline=inline), g)
            if not inline:
                g._inflight.append(w)
            return g.work([w], [], None, "barrier")

        return self._pl_tensor_work(go)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """gloo's monitored barrier, through the group's store (so a late rank does not break
        the communicator): rank 0 waits for every rank and names the ones that did not arrive
        within `timeout`; the others wait for rank 0's verdict."""
        g = self._g
        if hasattr(timeout, "timeout") and not isinstance(timeout, datetime.timedelta):
            timeout = timeout.timeout  # BarrierOptions
        if isinstance(timeout, datetime.timedelta):
            t = max(0.0, timeout.total_seconds())
        elif timeout is None:
            t = g.comm.timeout
        else:
            t = max(0.0, float(timeout))
        store = g.store
        if store is None:
            raise invalid("monitored_barrier: this group has no store")
        g.mb_seq += 1
        base = f"plait/monitored_barrier/{g.mb_seq}"
        import time

        start = time.monotonic()
        if g.rank != 0:
            store.set(f"{base}/arrived/{g.rank}", b"1")
            verdict = None
            try:
                store.wait([f"{base}/verdict"], datetime.timedelta(seconds=max(t, 0.001)))
                verdict = bytes(store.get(f"{base}/verdict")).decode()
            except Exception:
                pass
            if verdict != "ok":
                why = f"rank 0 reported: {verdict}" if verdict else f"no word from rank 0 within {t:g} s"
                raise torch_error(_core.PlaitTimeoutError(
                    f"Rank {g.rank} successfully reached monitoredBarrier, but received errors while waiting "
                    f"for send/recv from rank 0 ({why})"))
            return
        failed = []
        if t <= 0 and g.size > 1:
            msg = "Rank 0 timed out in monitoredBarrier after 0 ms"
            store.set(f"{base}/verdict", msg.encode())
            raise torch_error(_core.PlaitTimeoutError(msg))
        for r in range(1, g.size):
            left = t - (time.monotonic() - start)
            key = f"{base}/arrived/{r}"
            try:
                if left > 0:
                    store.wait([key], datetime.timedelta(seconds=left))
                elif not store.check([key]):
                    raise TimeoutError
            except Exception:
                failed.append(r)
                if not wait_all_ranks:
                    break
        ms = int(t * 1000)
        if failed:
            msg = (f"Rank {failed[0]} failed to pass monitoredBarrier in {ms} ms" if len(failed) == 1 and not wait_all_ranks
                   else f"Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier in {ms} ms")
            try:
                store.set(f"{base}/verdict", msg.encode())
            except Exception:
                pass
            raise torch_error(_core.PlaitTimeoutError(msg))
        store.set(f"{base}/verdict", b"ok")

    # -- point to point ------------------------------------------------------------------------

    def send(self, tensors, dstRank, tag=0):
        t = _one(tensors, "send")
        g = self._g
        dst = _rank_check(g, dstRank, "send")
        if dst == g.rank:
            raise invalid("send: a rank cannot send to itself")

        def go():
            st = g.staged()
            v = stg.real_view(t, None, "send")
            dt = stg.move_dtype(v.dtype)
            h = st.host(v, read=True, write=False)
            ptr, n = (h.data_ptr(), stg.nbytes(h))
            ptr = ptr if n else 0
            tg = int(tag) & _TAG_MASK
            comm = g.comm
            lane = g.lanes.get("send", dst, tg)
            small = n <= g.opts.inline_bytes and g.opts.inline != "never"
            done = lane.run(lambda: comm.send(ptr, n, dt, dst, tg, inline=True).wait() and dst, try_inline=small)
            return g.work([done], [t], st, f"send to rank {dst}", (t,))

        return self._pl_tensor_work(go)

    def recv(self, tensors, srcRank, tag=0):
        t = _one(tensors, "recv")
        g = self._g
        src = _rank_check(g, srcRank, "recv")
        if src == g.rank:
            raise invalid("recv: a rank cannot receive from itself")
        return self._pl_tensor_work(lambda: self._pl_recv(t, src, tag))

    def recv_anysource(self, tensors, tag=0):
        t = _one(tensors, "recv")
        return self._pl_tensor_work(lambda: self._pl_recv(t, -1, tag))

    def _pl_recv(self, t, src, tag):
        g = self._g
        st = g.staged()
        v = stg.real_view(t, None, "recv")
        dt = stg.move_dtype(v.dtype)
        h = st.host(v, read=False, write=True)
        ptr, n = (h.data_ptr(), stg.nbytes(h))
        ptr = ptr if n else 0
        tg = int(tag) & _TAG_MASK
        comm = g.comm

        def run():
            w = comm.recv(ptr, n, dt, src, tg, inline=True)
            w.wait()
            return w.source()

        done = g.lanes.get("recv", src, tg).run(run, try_inline=False)
        return g.work([done], [t], st, "recv" + (f" from rank {src}" if src >= 0 else " from any rank"), (t,))

    # -- coalescing ----------------------------------------------------------------------------
    # c10d's _coalescing_manager(device=...) brackets ops with start/endCoalescing. plait issues
    # each op at once (the core runs them concurrently), and endCoalescing returns a Work that
    # completes when every op issued in between has (never an empty, already-done Work: c10d
    # hands it to the caller in place of the ops' own).

    def startCoalescing(self, device=None):
        self._g.coalescing = []

    def endCoalescing(self, device=None):
        g = self._g
        works, g.coalescing = g.coalescing or [], None
        from .work import Sub

        outputs = [t for w in works for t in w._outputs]
        return PlaitWork(g, [Sub(w) for w in works], outputs, None, f"{len(works)} coalesced operations")

    def _start_coalescing(self, device=None):
        self.startCoalescing(device)

    def _end_coalescing(self, device=None):
        return self.endCoalescing(device)


def _abandon(parts, st):
    """A call failed before all of its core operations were started: wait (bounded) for those
    that did start and free the staging memory."""
    for p in parts:
        try:
            p.wait(30.0)
        except BaseException:
            pass
    st.finish(ok=False)


def _join(g, works, outputs, what):
    parts = []
    fins = []
    for w in works:
        parts.extend(w._parts)
        if w._finish_cb is not None:
            fins.append(w._finish_cb)
        w._parts, w._finish_cb, w._settled = [], None, True

    def fin(ok):
        for f in fins:
            f(ok)

    return PlaitWork(g, parts, outputs, fin, what)


def _in_place_or(st, vi, ho, rank):
    """The input of an allgather-into-tensor: when the input already is the output's block
    `rank` (in place), that block; else the input's host form."""
    n = stg.nbytes(vi)
    if n and st.direct(vi) and vi.data_ptr() == ho.data_ptr() + rank * n:
        return vi
    return st.host(vi, read=True, write=False)


def _split_counts(splits, t, n, dt, what):
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


def _wire_buffer(st, vs, wire, read=True, write=True):
    """A flat CPU buffer of dtype `wire` holding `vs` converted, copied back (converted) when the
    op ends."""
    total = sum(v.numel() for v in vs)
    h = torch.empty(total, dtype=wire)
    off = 0
    for v in vs:
        part = h[off : off + v.numel()].view(v.shape)
        if read:
            with torch.no_grad():
                part.copy_(v)
        if write:
            st._add_back(v, part)
        off += v.numel()
    st.keep.append(h)
    return h


class _AllgatherOptions:
    """Stand-in for torch's AllgatherOptions (not exported by torch.distributed)."""

    timeout = datetime.timedelta(milliseconds=-1)
    asyncOp = True


def _opts(opts, cls, rest, *fields):
    """The options object of a call, whether it came as torch's Options or as the positional
    convenience overload (`allreduce(tensor, op, timeout)` ...)."""
    if opts is None or not hasattr(opts, "timeout"):
        o = cls()
        args = ([opts] if opts is not None else []) + list(rest)
        for name, val in zip(fields + ("timeout",), args):
            if val is None:
                continue
            if name == "timeout":
                o.timeout = val
            elif name == "reduceOp" and not isinstance(val, dist.ReduceOp):
                o.reduceOp = dist.ReduceOp(val)
            else:
                setattr(o, name, val)
        return o
    return opts


class PlaitProcessGroup(_Methods, dist.ProcessGroup):
    """A torch ProcessGroup backed by plait."""

    def __init__(self, group, name="", desc="undefined"):
        dist.ProcessGroup.__init__(self, group.rank, group.size)
        self._g = group
        group.owner = weakref.ref(self)
        self._pl_name = name
        self._pl_desc = desc
        self._pl_backend = None
        # c10d asks groups for their per-device Backend (batch_isend_irecv, DeviceMesh, FSDP...):
        # register a Backend view of this same engine for every device plait serves.
        b = self._pl_backend_view()
        if b is not None:
            bt = getattr(dist.ProcessGroup.BackendType, "CUSTOM", None)
            for dev in ("cpu", "cuda", "mps"):
                try:
                    self._register_backend(torch.device(dev), bt, b)
                except Exception:
                    pass
            try:
                self._set_default_backend(bt)
            except Exception:
                pass

    def _get_backend(self, device=None):
        """The per-device Backend view (c10d asks it e.g. whether it supports coalescing)."""
        b = self._pl_backend_view()
        if b is None:
            return dist.ProcessGroup._get_backend(self, device)
        return b

    def get_backend(self, device=None):
        return self._get_backend(device)

    def _pl_backend_view(self):
        if self._pl_backend is None and PlaitBackend is not None:
            try:
                self._pl_backend = PlaitBackend(self._g, self._pl_name, self._pl_desc, owner=False)
            except Exception:  # pragma: no cover - torch without a constructible Backend
                self._pl_backend = None
        return self._pl_backend

    def __del__(self):
        g = getattr(self, "_g", None)
        if g is not None and not g.closed and not g.completer.in_thread():
            try:
                g.shutdown()
            except Exception:
                pass


_BackendBase = getattr(torch._C._distributed_c10d, "Backend", None)


if _BackendBase is not None:

    class PlaitBackend(_Methods, _BackendBase):
        """The per-device form, for mixed groups such as "cpu:plait,cuda:nccl"."""

        def __init__(self, group, name="", desc="undefined", owner=True):
            _BackendBase.__init__(self, group.rank, group.size)
            self._g = group
            self._pl_name = name
            self._pl_desc = desc
            self._pl_owner = owner  # False: a view of a PlaitProcessGroup's engine

        def name(self):
            return "plait"

        # Capability queries: answered in Python (the C++ properties would look for a Python
        # override of the same name and recurse).
        supports_coalescing = property(lambda self: False)
        supports_splitting = property(lambda self: False)
        supports_shrinking = property(lambda self: False)
        supports_reconfigure = property(lambda self: False)
        supports_window = property(lambda self: False)
        supports_abort_hooks = property(lambda self: False)
        _supports_time_estimate = property(lambda self: False)

        def __del__(self):
            g = getattr(self, "_g", None)
            if getattr(self, "_pl_owner", False) and g is not None and not g.closed and not g.completer.in_thread():
                try:
                    g.shutdown()
                except Exception:
                    pass

else:  # pragma: no cover
    PlaitBackend = None


def _next_epoch(store, size):
    """A number every member of this group gets the same value of, different from any earlier
    group built on the same store keys (torch reuses group names after destroy_process_group)."""
    try:
        n = store.add("plait/inits", 1)
    except Exception:
        return 0
    return (int(n) - 1) // max(1, size)


def _mixed_backend_config():
    """True when the group being built maps other devices to other backends
    ("cpu:plait,cuda:nccl"): then plait must be returned as a per-device Backend."""
    f = sys._getframe(1)
    for _ in range(6):
        if f is None:
            break
        cfg = f.f_locals.get("backend_config")
        if cfg is not None and hasattr(cfg, "get_device_backend_map"):
            try:
                backends = set(str(b) for b in cfg.get_device_backend_map().values())
            except Exception:
                return False
            return len(backends) > 1
        f = f.f_back
    return False


def create(dist_backend_opts, backend_options=None):
    """The creator torch calls (extended API) for each plait group."""
    o = from_pg_options(backend_options).resolved(dist_backend_opts.timeout)
    store = dist_backend_opts.store
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    gid = str(getattr(dist_backend_opts, "group_id", "") or "0")
    ranks = list(getattr(dist_backend_opts, "global_ranks_in_group", []) or [])
    epoch = _next_epoch(store, size)
    try:
        comm = _core.Comm(store, rank, size, timeout=o.timeout, group=f"torch/{gid}", epoch=epoch, algo=o.algo)
    except PlaitError as e:
        raise torch_error(e) from None
    g = _Group(comm, o, gid, ranks)
    g.store = store
    mixed = _mixed_backend_config() or os.environ.get("PLAIT_TORCH_CLASS") == "backend"
    if mixed and PlaitBackend is not None:
        return PlaitBackend(g, gid)
    return PlaitProcessGroup(g, gid)


def _close_all():
    for g in list(_GROUPS):
        try:
            g.shutdown()
        except Exception:
            pass


import atexit  # noqa: E402

atexit.register(_close_all)
