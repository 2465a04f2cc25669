"""c10d's ProcessGroup/Backend methods (old and new names), each a declaration of its call: which
tensors the core reads and writes, in which views, with which core operation, root, op and
counts. Checking, staging, starting, failure and the Work are `engine.issue`'s."""

import functools

import torch
import torch.distributed as dist

from . import staging as stg
from .allreduce_paths import small_allreduce, sparse_allreduce
from .arguments import (AllgatherOptions, blocks_of, group_rank, one_per_rank, one_tensor, options, peer_rank,
                        reduce_locally, reduce_op, root_list, root_tensor, same_kind, same_shape, split_counts)
from .engine import Op, issue
from .monitored_barrier import monitored_barrier
from .staging import invalid
from .work import PlaitWork, Sub, seconds
from .. import _core
from .._core import InvalidArgumentError, PlaitError

_AllreduceCoalescedOptions = getattr(dist, "AllreduceCoalescedOptions", dist.AllreduceOptions)

# The collectives: a call refused on one rank is refused on every rank (see `agreed`).
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced", "allgather_coalesced",
    "gather", "scatter", "gather_into_tensor", "gather_single", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "alltoall_base", "all_to_all_single", "alltoall", "barrier",
)


def agreed(method):
    """A collective this rank refuses (bad arguments, found before anything was sent) still
    counts as that call: the core tells the other ranks, whose part of it fails at once with
    the reason and this rank's name instead of waiting for this rank until the deadline; the
    group stays usable on every rank. (Arguments torch itself refuses before calling the backend
    are beyond reach: there, as with gloo, the other ranks wait.)"""

    @functools.wraps(method)
    def call(self, *args, **kw):
        try:
            return method(self, *args, **kw)
        except InvalidArgumentError as e:
            if not getattr(e, "plait_started", False):
                self._g.refuse(e)
            raise

    return call


def _single_and_coalesced(tensors_call, what):
    """The one-pair and the coalesced method of a call over (output, input) tensor pairs."""

    def single(self, output, input, opts=None):
        return tensors_call(self, [output], [input], opts, what)

    def coalesced(self, outputs, inputs, opts=None):
        return tensors_call(self, list(outputs), list(inputs), opts, what + "_coalesced")

    return single, coalesced


class Methods:
    """c10d's ProcessGroup/Backend interface over `self._g` (an engine.Group)."""

    # -- identity ------------------------------------------------------------------------------

    def getBackendName(self):
        return "plait"

    _get_backend_name = getBackendName

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

    def set_timeout(self, timeout):
        """The group's default deadline for every later operation (`dist.set_timeout`); an op's
        own `timeout=` still wins."""
        t = seconds(timeout)
        if t is None:
            raise invalid(f"set_timeout: the timeout must be positive, got {timeout}")
        try:
            self._g.default_timeout = _core.check_argument("timeout", t, "set_timeout")
        except PlaitError as e:
            raise invalid(str(e)) from None

    _set_default_timeout = set_timeout

    def _issue(self, what, opts, outputs, inputs, plan):
        return issue(self._g, self._pl_name, what, opts, outputs, inputs, plan)

    # -- allreduce -----------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None, *rest, **kw):
        if not rest and not kw and type(tensors) is list and len(tensors) == 1:
            w = small_allreduce(self._g, tensors[0], opts)
            if w is not None:
                return w
        opts = options(opts, dist.AllreduceOptions, rest, kw, "allreduce", "op")
        if isinstance(tensors, (list, tuple)) and len(tensors) == 1 and getattr(tensors[0], "layout", None) == torch.sparse_coo:
            self._g.check_open(self._pl_name)
            return sparse_allreduce(self._g, tensors[0], opts)
        if isinstance(tensors, (list, tuple)) and len(tensors) > 1:
            return self._allreduce_across(list(tensors), opts)
        return self._allreduce([one_tensor(tensors, "all_reduce")], opts, "all_reduce")

    def _allreduce_across(self, ts, opts):
        """gloo's older form with several tensors per process: every tensor receives the
        reduction of all of them on every rank. They are reduced here first, into one tensor
        that takes the collective; its result is copied into each."""
        what = "all_reduce"
        same_shape(ts, what)
        op, factor = reduce_op(opts.reduceOp)
        with torch.no_grad():
            acc = reduce_locally(ts, op)

        def plan(st):
            ops = self._allreduce_plan(st, [acc], op, factor, what)
            for t in ts:
                st.copy_back(t, acc)
            return ops

        return self._issue(what, opts, ts, ts, plan)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = options(opts, _AllreduceCoalescedOptions, (), {}, "allreduce_coalesced", "op")
        return self._allreduce([stg.check_tensor(t, "all_reduce_coalesced") for t in tensors], opts, "all_reduce_coalesced")

    def _allreduce(self, ts, opts, what):
        op, factor = reduce_op(opts.reduceOp)
        return self._issue(what, opts, list(ts), ts, lambda st: self._allreduce_plan(st, ts, op, factor, what))

    def _allreduce_plan(self, st, ts, op, factor, what):
        """The core allreduces of `ts` (one per dtype and device, each over their host form)."""
        g = self._g
        by_kind = {}  # one core call per (dtype, device), in first-appearance order (the same on every rank)
        for t in ts:
            v = stg.real_view(t, op, what)
            by_kind.setdefault((v.dtype, v.device.type), []).append(v)
        ops = []
        for (dtype, _device), vs in by_kind.items():
            core_wire = None
            if dtype == torch.float32:
                # The group's choice is explicit, so the core's PLAIT_WIRE_DTYPE default never applies.
                compress = g.wire_name is not None and op in ("sum", "avg", "premul_sum")
                core_wire = g.wire_name if compress else "native"
            wire = g.wire_for(dtype, op) if dtype == torch.float64 else None
            if wire is not None:
                h, dt = st.converted(vs, wire, read=True, write=True), stg.CORE_DTYPE[wire]
            else:
                dt = stg.reduce_dtype(vs[0], op, what)
                h = st.host(vs[0], read=True, write=True) if len(vs) == 1 else st.flat(vs, read=True, write=True)
            ops.append(Op("allreduce", h, h, dt, op=op, factor=factor, wire=core_wire))
        return ops

    # -- broadcast / reduce --------------------------------------------------------------------

    def broadcast(self, tensors, opts=None, *rest, **kw):
        """One tensor per process, or (gloo's older form) several: the root's tensor
        `opts.rootTensor` then goes into every tensor of every rank."""
        opts = options(opts, dist.BroadcastOptions, rest, kw, "broadcast", "root")
        what = "broadcast"
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not ts:
            raise invalid(f"{what}: expected at least one tensor")
        same_shape(ts, what)
        root = group_rank(self._g, opts.rootRank, what)
        k = root_tensor(opts, len(ts), what)
        is_root = self._g.rank == root
        t = ts[k]

        def plan(st):
            v = stg.real_view(t, None, what)
            h = st.host(v, read=is_root, write=not is_root)
            for other in ts:
                if other is not t:
                    st.copy_back(other, t)
            return [Op("broadcast", h if is_root else None, h, stg.move_dtype(v.dtype), root=root)]

        return self._issue(what, opts, ts, ts, plan)

    def reduce(self, tensors, opts=None, *rest, **kw):
        opts = options(opts, dist.ReduceOptions, rest, kw, "reduce", "root", "op")
        t = one_tensor(tensors, "reduce")
        root = group_rank(self._g, opts.rootRank, "reduce")
        root_tensor(opts, 1, "reduce")
        op, factor = reduce_op(opts.reduceOp)

        def plan(st):
            v = stg.real_view(t, op, "reduce")
            dt = stg.reduce_dtype(v, op, "reduce")
            # The root's result is built apart from its input (still being read), then copied in.
            out = st.separate(v) if self._g.rank == root else None
            return [Op("reduce", st.host(v, read=True, write=False), out, dt, op=op, factor=factor, root=root)]

        return self._issue("reduce", opts, [t], (t,), plan)

    # -- allgather -----------------------------------------------------------------------------

    def allgather(self, output_tensors, input_tensors, opts=None, *rest, **kw):
        """One input per process and a list of one output per rank; or (gloo's older form) T
        inputs and T output lists of T x group-size tensors, each list receiving every rank's
        inputs in rank order."""
        opts = options(opts, AllgatherOptions, rest, kw, "allgather")
        g, what = self._g, "all_gather"
        if isinstance(input_tensors, torch.Tensor):  # the (list, tensor) overload
            ins, lists = [input_tensors], [list(output_tensors)]
        else:
            ins, lists = list(input_tensors), [list(x) for x in output_tensors]
            if not ins:
                raise invalid(f"{what}: expected at least one input tensor")
            if len(lists) != len(ins):
                raise invalid(f"{what}: expected one output list per input tensor ({len(ins)}), got {len(lists)}")
        outs = lists[0]

        def plan(st):
            for t in ins:
                stg.check_tensor(t, what)
            if len(ins) == 1:
                one_per_rank(g, outs, ins[0], what, "output tensor", "input")
            else:
                same_shape(ins, what)
                for i, lst in enumerate(lists):
                    if len(lst) != g.size * len(ins):
                        raise invalid(f"{what}: output list {i} has {len(lst)} tensors, expected {g.size * len(ins)} "
                                      f"(the group size times the {len(ins)} inputs)")
                    same_shape([ins[0]] + lst, what)
            vins = [stg.real_view(t, None, what) for t in ins]
            vouts = [stg.real_view(o, None, what) for o in outs]
            dt = stg.move_dtype(vins[0].dtype)
            per_rank = len(ins)
            counts = [sum(stg.elems(o, dt) for o in vouts[r * per_rank:(r + 1) * per_rank]) for r in range(g.size)]
            send = st.host(vins[0], read=True, write=False) if per_rank == 1 else st.flat(vins, read=True, write=False)
            op = Op("allgather", send, st.flat(vouts, read=False, write=True), dt, recv_counts=counts)
            for lst in lists[1:]:
                for dst, src in zip(lst, outs):
                    st.copy_back(dst, src)
            return [op]

        return self._issue(what, opts, [t for lst in lists for t in lst], ins, plan)

    def _allgather_tensors(self, outputs, inputs, opts, what):
        opts = options(opts, AllgatherOptions, (), {}, what)
        g = self._g

        def plan(st):
            blocks_of(g, outputs, inputs, what, whole="output")
            ops = []
            for o, i in zip(outputs, inputs):
                vo, vi = stg.real_view(o, None, what), stg.real_view(i, None, what)
                ho = st.host(vo, read=False, write=True)
                ops.append(Op("allgather", st.in_place_or_host(vi, ho, g.rank), ho, stg.move_dtype(vi.dtype)))
            return ops

        return self._issue(what, opts, outputs, inputs, plan)

    _allgather_base, allgather_into_tensor_coalesced = _single_and_coalesced(_allgather_tensors, "all_gather_into_tensor")
    all_gather_single, all_gather_single_coalesced = _allgather_base, allgather_into_tensor_coalesced  # newer names

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][i] receives rank r's input_list[i]: one allgather of the inputs laid
        end to end."""
        opts = options(opts, AllgatherOptions, (), {}, "allgather_coalesced")
        g, what = self._g, "all_gather_coalesced"
        ins = list(input_list)
        outs = [list(x) for x in output_lists]

        def plan(st):
            if len(outs) != g.size:
                raise invalid(f"{what}: expected {g.size} output lists (one per rank), got {len(outs)}")
            if not ins:
                return []
            same_kind(ins, ins[0], what)
            for r, lst in enumerate(outs):
                if len(lst) != len(ins):
                    raise invalid(f"{what}: output list {r} has {len(lst)} tensors for {len(ins)} inputs")
                same_kind(lst, ins[0], what)
            for i, t in enumerate(ins):
                if outs[g.rank][i].numel() != t.numel():
                    raise invalid(f"{what}: output [{g.rank}][{i}] has {outs[g.rank][i].numel()} elements, input {i} has {t.numel()}")
            vins = [stg.real_view(t, None, what) for t in ins]
            vouts = [[stg.real_view(t, None, what) for t in lst] for lst in outs]
            dt = stg.move_dtype(vins[0].dtype)
            return [Op("allgather", st.flat(vins, read=True, write=False), st.flat(sum(vouts, []), read=False, write=True), dt,
                       recv_counts=[sum(stg.elems(v, dt) for v in lst) for lst in vouts])]

        return self._issue(what, opts, [t for lst in outs for t in lst] if ins else [], ins, plan)

    # -- gather / scatter ----------------------------------------------------------------------

    def gather(self, output_tensors, input_tensors, opts=None, *rest, **kw):
        return self._rooted("gather", output_tensors, input_tensors, options(opts, dist.GatherOptions, rest, kw, "gather", "root"))

    def scatter(self, output_tensors, input_tensors, opts=None, *rest, **kw):
        return self._rooted("scatter", output_tensors, input_tensors, options(opts, dist.ScatterOptions, rest, kw, "scatter", "root"))

    def _rooted(self, kind, output_tensors, input_tensors, opts):
        """gather or scatter of one tensor per rank: the root's list (the gather's outputs, the
        scatter's inputs) against every rank's one tensor."""
        gathers = kind == "gather"
        one_arg, list_arg = (input_tensors, output_tensors) if gathers else (output_tensors, input_tensors)
        flat = isinstance(one_arg, torch.Tensor)  # torch's overload that passes the root's list alone
        one = one_arg if flat else one_tensor(one_arg, kind)
        root = group_rank(self._g, opts.rootRank, kind)
        many = root_list(self._g, list_arg, flat, one, root, kind, "output" if gathers else "input")
        return self._issue_rooted(kind, one, many, root, opts, kind, per_rank=True)

    def gather_into_tensor(self, output, input, opts=None):
        opts = options(opts, dist.GatherOptions, (), {}, "gather_into_tensor", "root")
        g, what = self._g, "gather_into_tensor"
        root = group_rank(g, opts.rootRank, what)
        if g.rank == root:
            same_kind([output], input, what)
            if output.numel() != g.size * input.numel():
                raise invalid(f"{what}: the output must have world_size ({g.size}) times the input's elements")
        return self._issue_rooted("gather", input, [output] if g.rank == root else [], root, opts, what, per_rank=False)

    gather_single = gather_into_tensor

    def _issue_rooted(self, kind, one, many, root, opts, what, per_rank):
        """The core gather (every rank's `one` into `many` at the root) or scatter (the root's
        `many` into every rank's `one`); `many` is one tensor per rank (`per_rank`) or one tensor
        of every rank's block, and empty off the root."""
        gathers = kind == "gather"

        def plan(st):
            v = stg.real_view(one, None, what)
            dt = stg.move_dtype(v.dtype)
            vs = [stg.real_view(t, None, what) for t in many]
            h = st.host(v, read=gathers, write=not gathers)
            hs = st.flat(vs, read=not gathers, write=gathers) if many else None
            counts = [stg.elems(t, dt) for t in vs] if many and per_rank else None
            if gathers:
                return [Op("gather", h, hs, dt, root=root, recv_counts=counts)]
            return [Op("scatter", hs, h, dt, root=root, send_counts=counts)]

        outputs, inputs = (list(many), (one,)) if gathers else ([one], many or (one,))
        return self._issue(what, opts, outputs, inputs, plan)

    # -- reduce_scatter ------------------------------------------------------------------------

    def reduce_scatter(self, output_tensors, input_tensors, opts=None, *rest, **kw):
        opts = options(opts, dist.ReduceScatterOptions, rest, kw, "reduce_scatter", "op")
        g, what = self._g, "reduce_scatter"
        if isinstance(output_tensors, torch.Tensor):  # (tensor, list, op) overload
            out, ins = output_tensors, list(input_tensors)
        else:
            out = one_tensor(output_tensors, what)
            if len(input_tensors) != 1:
                raise invalid(f"{what}: expected one input list per process, got {len(input_tensors)}")
            ins = list(input_tensors[0])
        op, factor = reduce_op(opts.reduceOp)

        def plan(st):
            one_per_rank(g, ins, out, what, "input tensor", "output")
            vins = [stg.real_view(i, op, what) for i in ins]
            return [self._reduce_scatter_op(st, vins, stg.real_view(out, op, what), op, factor, what,
                                            counts=[i.numel() for i in vins])]

        return self._issue(what, opts, [out], ins, plan)

    def _reduce_scatter_tensors(self, outputs, inputs, opts, what):
        opts = options(opts, dist.ReduceScatterOptions, (), {}, what, "op")
        op, factor = reduce_op(opts.reduceOp)

        def plan(st):
            blocks_of(self._g, outputs, inputs, what, whole="input")
            return [self._reduce_scatter_op(st, [stg.real_view(i, op, what)], stg.real_view(o, op, what), op, factor, what)
                    for o, i in zip(outputs, inputs)]

        return self._issue(what, opts, outputs, inputs, plan)

    _reduce_scatter_base, reduce_scatter_tensor_coalesced = _single_and_coalesced(_reduce_scatter_tensors, "reduce_scatter_tensor")
    reduce_scatter_single, reduce_scatter_single_coalesced = _reduce_scatter_base, reduce_scatter_tensor_coalesced  # newer names

    def _reduce_scatter_op(self, st, vins, vout, op, factor, what, counts=None):
        """The core reduce_scatter of `vins` (laid end to end) into `vout`, in the group's wire
        dtype where that applies."""
        wire = self._g.wire_for(vout.dtype, op)
        if wire is not None:
            hin, hout = st.converted(vins, wire, read=True, write=False), st.converted([vout], wire, read=False, write=True)
            dt = stg.CORE_DTYPE[wire]
        else:
            dt = stg.reduce_dtype(vout, op, what)
            hin, hout = st.flat(vins, read=True, write=False), st.host(vout, read=False, write=True)
        return Op("reduce_scatter", hin, hout, dt, op=op, factor=factor, recv_counts=counts)

    # -- alltoall ------------------------------------------------------------------------------

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None, *rest, **kw):
        opts = options(opts, dist.AllToAllOptions, rest, kw, "alltoall_base")
        g, what = self._g, "all_to_all_single"

        def plan(st):
            stg.check_tensor(output, what)
            stg.check_tensor(input, what)
            same_kind([output], input, what)
            vo, vi = stg.real_view(output, None, what), stg.real_view(input, None, what)
            dt = stg.move_dtype(vi.dtype)
            send_counts = split_counts(list(input_split_sizes), vi, g.size, dt, "input")
            recv_counts = split_counts(list(output_split_sizes), vo, g.size, dt, "output")
            ho = st.host(vo, read=False, write=True)
            hi = st.apart_from(st.host(vi, read=True, write=False), ho)
            return [Op("alltoall", hi, ho, dt, send_counts=send_counts, recv_counts=recv_counts)]

        return self._issue(what, opts, [output], (input,), plan)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None, *rest, **kw):
        opts = options(opts, dist.AllToAllOptions, rest, kw, "alltoall")
        g, what = self._g, "all_to_all"
        outs, ins = list(output_tensors), list(input_tensors)

        def plan(st):
            if len(outs) != g.size or len(ins) != g.size:
                raise invalid(f"{what}: expected {g.size} input and output tensors, got {len(ins)} and {len(outs)}")
            same_kind(outs + ins, ins[0], what)
            vins = [stg.real_view(t, None, what) for t in ins]
            vouts = [stg.real_view(t, None, what) for t in outs]
            dt = stg.move_dtype(vins[0].dtype)
            ho = st.flat(vouts, read=False, write=True)
            hi = st.apart_from(st.flat(vins, read=True, write=False), ho)
            return [Op("alltoall", hi, ho, dt, send_counts=[stg.elems(t, dt) for t in vins],
                       recv_counts=[stg.elems(t, dt) for t in vouts])]

        return self._issue(what, opts, outs, ins, plan)

    # -- barrier -------------------------------------------------------------------------------

    def barrier(self, opts=None, *rest, **kw):
        opts = options(opts, dist.BarrierOptions, rest, kw, "barrier")
        return self._issue("barrier", opts, [], (), lambda st: [Op("barrier")])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return monitored_barrier(self._g, timeout, wait_all_ranks)

    # -- point to point ------------------------------------------------------------------------
    # The core starts a transfer when it is called, in call order, so messages between two ranks
    # with one tag match in the order they were issued; the Work only waits.

    def send(self, tensors, dstRank, tag=0):
        t = one_tensor(tensors, "send")
        dst = peer_rank(self._g, dstRank, "send", "send to itself")

        def plan(st):
            v = stg.real_view(t, None, "send")
            return [Op("send", st.host(v, read=True, write=False), None, stg.move_dtype(v.dtype), peer=dst, tag=tag)]

        return self._issue(f"send to rank {dst}", None, [t], (t,), plan)

    def recv(self, tensors, srcRank, tag=0):
        t = one_tensor(tensors, "recv")
        return self._recv(t, peer_rank(self._g, srcRank, "recv", "receive from itself"), tag)

    def recv_anysource(self, tensors, tag=0):
        return self._recv(one_tensor(tensors, "recv"), -1, tag)

    def _recv(self, t, src, tag):
        def plan(st):
            v = stg.real_view(t, None, "recv")
            return [Op("recv", None, st.host(v, read=False, write=True), stg.move_dtype(v.dtype), peer=src, tag=tag)]

        return self._issue("recv" + (f" from rank {src}" if src >= 0 else " from any rank"), None, [t], (t,), plan)

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
        outputs = [t for w in works for t in w._outputs]
        return PlaitWork(g, [Sub(w) for w in works], outputs, None, f"{len(works)} coalesced operations")

    _start_coalescing, _end_coalescing = startCoalescing, endCoalescing


for _name in COLLECTIVES:
    setattr(Methods, _name, agreed(getattr(Methods, _name)))
