"""The engine of one plait c10d group, and the one path every torch call takes to the core.

`Group` holds one core communicator (its own links), the staging pool, the completion thread and
the state c10d needs kept (what is in flight, what a coalescing bracket issued). `issue()` is how a
c10d call reaches the core: the call's plan stages its tensors and names its core operations
(`Op`s); `issue` decides whether they run on the caller's thread, starts them in order and returns
the Work, or, when anything fails before all have started, waits for those that did and frees the
staging memory before the error goes up.
"""

import collections
import threading
import weakref

import torch
import torch.distributed as dist

from .. import _core
from .._core import BrokenError, PlaitError
from . import debug, trace
from . import staging as stg
from .staging import HostPool, Staged
from .work import Completer, PlaitWork, seconds, torch_error

_CAST_OPS = ("sum", "avg", "premul_sum", "min", "max")  # reductions that may travel in a narrower float
_GROUPS = weakref.WeakSet()  # live groups, so that interpreter exit can close them


class Op:
    """One core operation on host tensors: a collective by its core name ("allreduce",
    "alltoall"...), "barrier", "send" or "recv". `send`/`recv` are what the core reads and writes
    (None: nothing); `args` are the core call's own (op, factor, root, counts, wire; peer and tag
    for point-to-point)."""

    __slots__ = ("kind", "send", "recv", "dtype", "args")

    def __init__(self, kind, send=None, recv=None, dtype="u8", **args):
        self.kind, self.send, self.recv, self.dtype, self.args = kind, send, recv, dtype, args

    @property
    def nbytes(self):
        return max(_bytes(self.send), _bytes(self.recv))


def _bytes(t):
    return stg.nbytes(t) if t is not None else 0


def _address(t):
    n = _bytes(t)
    return (t.data_ptr() if n else 0), n


class Group:
    """The engine of one c10d group (one device's backend)."""

    def __init__(self, comm, opts, group_id, global_ranks, store=None):
        self.comm = comm
        self.opts = opts
        self._take_identity(comm)
        self.group_id = group_id
        self.global_ranks = list(global_ranks) if global_ranks else list(range(comm.size))
        self.store = store
        self.completer = Completer(f"g{group_id}-r{comm.rank}")
        self.pool = HostPool(opts.staging_cache_bytes)
        self._inflight = collections.deque()
        self._lock = threading.Lock()
        self.closed = False
        self.mb_seq = 0  # monitored barriers so far (their store keys)
        self.coalescing = None  # works issued between startCoalescing and endCoalescing
        self.default_timeout = None  # seconds, once set_timeout() changed the group's default
        self.owner = None  # weakref to the torch-facing object (for profiler labels)
        # float32 allreduce goes through the core's codec (each contribution encoded once, results
        # bit-identical on every rank); other float reductions are cast to `wire` here (no int8).
        self.wire_name = opts.wire_dtype
        self.wire = stg.WIRE_DTYPE.get(opts.wire_dtype)
        self.trace, self.check = debug.attach(self)  # the recorder (plait trace) and the DETAIL check, or None
        _GROUPS.add(self)

    def _take_identity(self, comm):
        """A static group's rank and size are fixed at its creation (an elastic one's follow its
        view: `elastic_group.ElasticGroup`)."""
        self.rank = comm.rank
        self.size = comm.size

    def op_timeout(self, timeout):
        """The deadline (seconds, or None for the core's default) of an op whose options say
        `timeout` (torch's "unset" is negative): the op's own, else the group's current default."""
        t = seconds(timeout)
        return t if t is not None else self.default_timeout

    @property
    def timeout(self):
        """The group's current default deadline in seconds."""
        return self.default_timeout if self.default_timeout is not None else self.comm.timeout

    def check_open(self, name):
        """Raises (in torch's form) once the group has been shut down; `name`: its c10d name."""
        if self.closed:
            raise torch_error(BrokenError(f"plait: process group {name!r} was shut down"))

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

    def wire_for(self, dtype, op):
        """The narrower float type a reduction of `dtype` with `op` travels in here, or None."""
        if self.wire is not None and dtype in (torch.float32, torch.float64) and op in _CAST_OPS:
            return self.wire
        return None

    def runs_inline(self, opts, ops):
        """Whether a call's core operations run on the caller's thread (GIL released): a thread
        hand-off costs more than a small operation. A collective must be blocking (torch says so
        in opts.asyncOp), small enough, and alone in flight in this group: an inline call has its
        thread read the links (the core's caller progress), which would take them from the
        receiver threads that serve a larger operation in flight. Point-to-point never: c10d does not say whether
        a send or receive is blocking, the core starts the transfer at the call anyway, and
        switching the links between the caller and their own threads at every message costs more
        than the hand-off saves (a blocking 4-byte round trip took ~10% longer with small sends
        inline)."""
        mode = self.opts.inline
        if mode == "never" or any(op.kind in ("send", "recv") for op in ops):
            return False
        if profiling() or getattr(opts, "asyncOp", True) is not False:
            return False
        if mode == "auto" and sum(op.nbytes for op in ops) > self.opts.inline_bytes:
            return False
        return self.idle()

    def start(self, op, timeout, inline):
        """Starts `op` in the core; returns the core's Work."""
        comm = self.comm
        if op.kind in ("send", "recv"):
            ptr, n = _address(op.send if op.kind == "send" else op.recv)
            call = comm.send if op.kind == "send" else comm.recv
            w = call(ptr, n, op.dtype, op.args["peer"], _tag(op.args.get("tag", 0)), timeout=timeout, inline=inline)
        elif op.kind == "barrier":
            w = comm.barrier(timeout=timeout, inline=inline)
        else:
            (sp, sn), (rp, rn) = _address(op.send), _address(op.recv)
            w = comm.collective(op.kind, sp, sn, rp, rn, op.dtype, timeout=timeout, inline=inline, **op.args)
        if not inline:
            self._inflight.append(w)
        return w

    def work(self, parts, outputs, st, what, inputs=()):
        w = PlaitWork(self, parts, outputs, st.finish if st is not None else None, what)
        if profiling():
            _profile(self, w, what, inputs)
        if self.coalescing is not None:
            self.coalescing.append(w)
        return w

    def refuse(self, err):
        """This rank refused a collective's arguments (`err`): the call still counts here, and
        the other ranks' part of it fails with the reason instead of waiting for this rank."""
        if self.closed:
            return
        try:
            self.comm.refuse(str(err))
        except PlaitError:  # already broken or closed: the peers hear that instead
            pass

    def shutdown(self, abort_reason=None):
        with self._lock:
            if self.closed:
                return
            self.closed = True
        debug.detach(self)
        try:
            if abort_reason is not None:
                self.comm.abort(abort_reason)
            self.comm.close()
        finally:
            self.completer.stop()
            self.pool.clear()
            _GROUPS.discard(self)


def _tag(tag):
    """A user's tag as the core takes it: the core keeps tags from RESERVED_TAGS up for itself."""
    tag = int(tag)
    if not 0 <= tag < _core.RESERVED_TAGS:
        raise stg.invalid(f"tag {tag} is out of range: tags go from 0 to 2**63 - 1")
    return tag


def issue(g, name, what, opts, outputs, inputs, plan):
    """The path of every c10d tensor call: `plan(staged)` checks the call, stages its tensors and
    returns its core operations; they are started in order (on the caller's thread when
    `g.runs_inline` says so) and become one Work over `outputs`. A failure before every operation
    has started waits (bounded) for those that did, frees the staging memory and raises in torch's
    form. `name` is the group's c10d name, `what` the call's, for messages."""
    g.check_open(name)
    rec = g.trace.begin(what, opts, inputs, outputs) if g.trace is not None else None
    st = Staged(g.pool, g.opts.force_staging)
    parts = []
    try:
        if g.check is not None:
            g.check.run(what, opts, inputs, outputs)  # TORCH_DISTRIBUTED_DEBUG=DETAIL: raises on every rank
        ops = plan(st)
        inline = g.runs_inline(opts, ops)
        timeout = g.op_timeout(getattr(opts, "timeout", None))
        for op in ops:
            parts.append(g.start(op, timeout, inline))
    except PlaitError as e:
        _abandon(parts, st)
        err = torch_error(e, g.context())
        err.plait_started = bool(parts)  # part of the call is under way: not a refusal
        if rec is not None:
            trace.end(rec, err)
        raise err from None
    except BaseException as e:
        _abandon(parts, st)
        if rec is not None:
            trace.end(rec, e)
        raise
    w = g.work(parts, outputs, st, what, inputs)
    if rec is not None:
        trace.started(rec, w)
    return w


def _abandon(parts, st):
    """A call failed before all of its core operations were started: wait (bounded) for those
    that did start and free the staging memory."""
    for p in parts:
        try:
            p.wait(30.0)
        except BaseException:
            pass
    st.finish(ok=False)


_PROF_NAMES = {
    "all_to_all_single": "all_to_all",
    "recv from any rank": "recvAnySource",
}


def profiling():
    """Whether torch's autograd profiler is recording (calls then record an event each)."""
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


def close_all():
    """Closes every live group (at interpreter exit: their threads must not outlive torch)."""
    for g in list(_GROUPS):
        try:
            g.shutdown()
        except Exception:
            pass
