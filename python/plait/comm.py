"""The direct API: collectives on numpy arrays (and anything with the buffer protocol).

Every method validates its arguments before the core sees them, takes `timeout=` (seconds, default:
the communicator's) and `async_op=`; blocking calls return the output array, async calls return a
`Work` that keeps the buffers alive until the operation ends.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _core
from ._buffers import (
    addr,
    as_input,
    as_output,
    check_counts,
    check_out,
    check_rank,
    separate,
)
from ._core import InvalidArgumentError, PlaitTimeoutError
from ._dtypes import check_op, core_dtype

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

    # What a call returns: the output array (None on ranks that get none), or with async_op=True
    # a Work whose result() is that.
    Result = Any

_POLL = 0.25  # seconds between checks for Ctrl-C while a wait for a Work blocks


class Work:
    """Handle of an operation started with `async_op=True`."""

    __slots__ = ("_work", "_keep", "_result")

    def __init__(self, work, keep, result):
        self._work = work
        self._keep = keep  # buffers the core reads or writes: alive until the op ends
        self._result = result

    def wait(self, timeout: Optional[float] = None) -> bool:
        """True once the operation is done, False if `timeout` seconds passed first.
        Raises the operation's error (a PlaitError subclass) if it failed."""
        try:
            done = self._work.wait(timeout)
        except BaseException:
            if self._work.is_completed():
                self._keep = None
            raise
        if done:
            self._keep = None
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def result(self, timeout: Optional[float] = None) -> Optional[np.ndarray]:
        """Waits, then returns the output array (None where the rank gets no output)."""
        if not self.wait(timeout):
            raise PlaitTimeoutError(f"operation not complete after {timeout} s")
        return self._result

    def source(self) -> int:
        """For a receive: the rank the message came from."""
        return self._work.source()

    def _block(self):
        while not self.wait(_POLL):  # short waits so that Ctrl-C is seen
            pass
        return self._result


class Communicator:
    """`world_size` processes that meet through `store` (torch's TCPStore or anything with
    set / get / wait) and then talk over a full mesh of TCP connections.

    Threads: ranks match collectives by the order each rank calls them, so the collectives of one
    communicator (barrier included) must come from one thread. With `threads="creator"` (the
    default) only the thread that created the communicator may call them; any other thread gets
    InvalidArgumentError before anything is sent. For several threads, give each its own
    subgroup, created on that thread (`comm.subgroup(ranks, name)`). `threads="sequential"` lets
    any thread call, one at a time, when your program orders the calls the same on every rank: a
    collective started while another thread is starting one, or while another thread's blocking
    collective is still running, raises InvalidArgumentError and breaks the communicator on every
    rank (it may have been paired with a different call on another rank); an async_op=True call
    counts only until it is issued; calls that never overlap cannot be checked. Waiting for a Work, `abort()`,
    `close()`, `send` and `recv` (matched per peer and tag) work from any thread.
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout: Optional[float] = None,
                 group: str = "default", epoch: int = 0, algo: Optional[str] = None,
                 threads: str = "creator", schedules: Any = None) -> None:
        w = "Communicator"
        world_size = _core.check_argument("world_size", _int(world_size, w, "world_size"), w)
        rank = check_rank(rank, world_size, w, "rank")
        kw = {"group": _str(group, w, "group"), "epoch": _core.check_argument("epoch", _int(epoch, w, "epoch"), w)}
        if timeout is not None:
            kw["timeout"] = _timeout(timeout, "Communicator")
        if algo is not None:
            kw["algo"] = _str(algo, w, "algo")
        if schedules is not None:
            from .schedule import paths_setting

            kw["schedules"] = paths_setting(schedules, w)
        self._store = store
        self._pending = []
        self._comm = _core.Comm(store, rank, world_size, threads=_str(threads, w, "threads"), **kw)

    # -- identity ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.size

    size = world_size

    @property
    def epoch(self) -> int:
        return self._comm.epoch

    @property
    def group(self) -> str:
        return self._comm.group

    @property
    def threads(self) -> str:
        """Which threads may call collectives: "creator" or "sequential" (see the class)."""
        return self._comm.threads

    def __repr__(self):
        return f"<plait.Communicator rank {self.rank}/{self.world_size} group {self.group!r} epoch {self.epoch}>"

    def algorithm_for(self, coll: str, nbytes: int, root: int = 0) -> str:
        """The algorithm the selector would use for this collective and size."""
        return self._comm.algorithm_for(coll, nbytes, root)

    def predict(self, coll: str, nbytes: int, root: int = 0, algo: Optional[str] = None) -> Tuple[float, str]:
        """The cost model's estimate (seconds) of `coll` over `nbytes` with `algo` (the selector's
        choice when None), and the schedule it priced, e.g. "ring (order 0>2>1>3)": what the
        selector compares to choose. With measured links (`PLAIT_MEASURE`) each link is priced at
        its own latency and rate."""
        return self._comm.predict(coll, nbytes, root, algo)

    def fit_cost_model(self, runs: List[Tuple[str, str, int, int, float]]) -> Dict[str, Any]:
        """The cost model's constants fitted to measured runs `(coll, algo, nbytes, root, seconds)`:
        `{"setting": the PLAIT_COST_MODEL text that uses them, "alpha", "bandwidth", "gamma",
        "before", "after"}` (each run's prediction with the constants in use and with the fitted
        ones). Local to this rank; `plait topology --fit` measures the runs and calls it."""
        return self._comm.fit_cost_model(runs)

    def routes(self) -> List[Dict[str, Any]]:
        """Per peer: the local and remote address and interface used, why, the start-up RTT, the
        number of TCP streams (`PLAIT_STREAMS`), the rate measured from that peer (`rx_bytes_per_s`,
        bytes/s; None unless the links were measured, `PLAIT_MEASURE`), and whether large payloads go
        through shared memory (`shm_lanes`: 1 between ranks of one host, `PLAIT_SHM_BYTES`)."""
        return self._comm.routes()

    def ring_order(self) -> List[int]:
        """The order ring algorithms pass data in: rank `order[p]` sends to `order[p + 1]`. The rank
        order, unless the links were measured (`PLAIT_MEASURE`) or `PLAIT_RING_ORDER` gives one;
        every rank has the same."""
        return self._comm.ring_order()

    def link_matrix(self) -> Optional[Dict[str, List[List[Optional[float]]]]]:
        """Every directed link as measured at start-up: `{"latency_s": m, "bytes_per_s": m}`
        with `m[i][j]` for the link from rank i to rank j (bytes per second; latency is half the
        round trip), the same on every rank; None when the links were not measured
        (`PLAIT_MEASURE`: by default only when every rank has a host of its own)."""
        m = self._comm.link_matrix()
        return None if m is None else {"latency_s": m[0], "bytes_per_s": m[1]}

    def topology(self) -> str:
        """"full_mesh", "shared", "partial_mesh" or "single": how the ranks are wired (all agree)."""
        return self._comm.topology()

    def subgroup(self, ranks: Sequence[int], name: str, *, timeout: Optional[float] = None,
                 algo: Optional[str] = None) -> Communicator:
        """A communicator over `ranks` of this one (their order gives the new ranks), sharing this
        one's connections: no socket is opened and nothing is sent, so it costs microseconds. Every
        member calls it with the same `ranks` and `name`; a name serves one subgroup only. It fails
        if this communicator fails, but its own failures (a timeout, a mismatch) leave this one
        and the other subgroups working. Close it before this one. Its collectives belong to the
        thread that creates it (with threads="creator"): a subgroup per thread is how several
        threads run collectives at once."""
        ranks = [check_rank(r, self.world_size, "subgroup", "ranks") for r in ranks]
        kw = {}
        if timeout is not None:
            kw["timeout"] = _timeout(timeout, "subgroup")
        if algo is not None:
            kw["algo"] = algo
        sub = Communicator.__new__(Communicator)
        sub._store = self._store
        sub._pending = []
        sub._comm = self._comm.subgroup(str(name), ranks, **kw)
        return sub

    # -- reductions ----------------------------------------------------------------------------
    def allreduce(self, x: ArrayLike, op: str = "sum", *, out: Optional[ArrayLike] = None,
                  factor: Optional[float] = None, timeout: Optional[float] = None, algo: Optional[str] = None, wire: Optional[str] = None,
                  async_op: bool = False) -> Result:
        """`wire` ("bf16", "f16", "int8") compresses f32 data on the wire; every rank still ends
        with bit-identical results (default: PLAIT_WIRE_DTYPE, else uncompressed)."""
        w = "allreduce"
        a = as_input(x, w)
        dt = core_dtype(a.dtype)
        op, factor = check_op(op, dt, factor)
        o = self._out(out, a, a.size, w, a.shape)
        send = separate(a, o, in_place_ok=_same(a, o))
        return self._run(w, send, o, dt, o, op=op, factor=factor, timeout=timeout, algo=algo, wire=wire,
                         async_op=async_op)

    def reduce(self, x: ArrayLike, root: int, op: str = "sum", *, out: Optional[ArrayLike] = None,
               factor: Optional[float] = None, timeout: Optional[float] = None, algo: Optional[str] = None, async_op: bool = False) -> Result:
        """Result in `out` (returned) on `root`; other ranks return None."""
        w = "reduce"
        a = as_input(x, w)
        dt = core_dtype(a.dtype)
        root = check_rank(root, self.world_size, w, "root")
        op, factor = check_op(op, dt, factor)
        o = self._out(out, a, a.size, w, a.shape) if self.rank == root else _empty(a)
        send = separate(a, o)
        result = o if self.rank == root else None
        return self._run(w, send, o, dt, result, op=op, factor=factor, root=root, timeout=timeout, algo=algo,
                         async_op=async_op)

    def reduce_scatter(self, x: ArrayLike, op: str = "sum", *, out: Optional[ArrayLike] = None,
                       factor: Optional[float] = None, timeout: Optional[float] = None, algo: Optional[str] = None, async_op: bool = False) -> Result:
        """x holds world_size equal blocks (x.shape[0] == world_size, or flat); this rank gets the
        reduction of block `rank`. In place when out is block `rank` of x."""
        w = "reduce_scatter"
        a = as_input(x, w)
        n = self.world_size
        if a.size % n:
            raise InvalidArgumentError(f"{w}: x has {a.size} elements, not a multiple of world size {n}")
        c = a.size // n
        shape = a.shape[1:] if a.ndim >= 2 and a.shape[0] == n else (c,)
        return self._reduce_scatter(w, a, [c] * n, op, out, factor, timeout, algo, async_op, shape, None)

    def reduce_scatter_v(self, x: ArrayLike, counts: Sequence[int], op: str = "sum", *,
                         out: Optional[ArrayLike] = None, factor: Optional[float] = None, timeout: Optional[float] = None, algo: Optional[str] = None,
                         async_op: bool = False) -> Result:
        """Uneven reduce_scatter: block r of x has counts[r] elements."""
        w = "reduce_scatter_v"
        a = as_input(x, w)
        counts = check_counts(counts, self.world_size, w, total=a.size)
        return self._reduce_scatter(w, a, counts, op, out, factor, timeout, algo, async_op,
                                    (counts[self.rank],), counts)

    def _reduce_scatter(self, w, a, counts, op, out, factor, timeout, algo, async_op, shape, core_counts):
        dt = core_dtype(a.dtype)
        op, factor = check_op(op, dt, factor)
        o = self._out(out, a, counts[self.rank], w, shape)
        mine = a.reshape(-1)[sum(counts[: self.rank]):][: counts[self.rank]]
        send = separate(a, o, in_place_ok=_same(mine, o))
        return self._run("reduce_scatter", send, o, dt, o, op=op, factor=factor, recv_counts=core_counts,
                         timeout=timeout, algo=algo, async_op=async_op)

    # -- data movement ---------------------------------------------------------------------------
    def broadcast(self, x: ArrayLike, root: int, *, timeout: Optional[float] = None, algo: Optional[str] = None, async_op: bool = False) -> Result:
        """Copies root's x into x on every rank (in place); returns x."""
        w = "broadcast"
        a = as_output(x, w, "x")
        dt = core_dtype(a.dtype)
        root = check_rank(root, self.world_size, w, "root")
        send = a if self.rank == root else _empty(a)
        return self._run(w, send, a, dt, a, root=root, timeout=timeout, algo=algo, async_op=async_op)

    def allgather(self, x: ArrayLike, *, out: Optional[ArrayLike] = None, timeout: Optional[float] = None, algo: Optional[str] = None,
                  async_op: bool = False) -> Result:
        """Every rank's x, stacked: shape (world_size, *x.shape). In place when x is block `rank`
        of out."""
        a = as_input(x, "allgather")
        n = self.world_size
        return self._allgather("allgather", a, [a.size] * n, out, (n,) + a.shape, None, timeout, algo, async_op)

    def allgather_v(self, x: ArrayLike, counts: Sequence[int], *, out: Optional[ArrayLike] = None, timeout: Optional[float] = None, algo: Optional[str] = None,
                    async_op: bool = False) -> Result:
        """Uneven allgather: rank r contributes counts[r] elements; out is 1-D, sum(counts) long."""
        w = "allgather_v"
        a = as_input(x, w)
        counts = check_counts(counts, self.world_size, w)
        if counts[self.rank] != a.size:
            raise InvalidArgumentError(f"{w}: counts[{self.rank}]={counts[self.rank]} but x has {a.size} elements")
        return self._allgather(w, a, counts, out, (sum(counts),), counts, timeout, algo, async_op)

    def _allgather(self, w, a, counts, out, shape, core_counts, timeout, algo, async_op):
        core_dtype(a.dtype)
        o = self._out(out, a, sum(counts), w, shape)
        mine = o.reshape(-1)[sum(counts[: self.rank]):][: counts[self.rank]]
        send = separate(a, o, in_place_ok=_same(a, mine))
        return self._run("allgather", send, o, core_dtype(a.dtype), o, recv_counts=core_counts, timeout=timeout,
                         algo=algo, async_op=async_op)

    def gather(self, x: ArrayLike, root: int, *, out: Optional[ArrayLike] = None,
               counts: Optional[Sequence[int]] = None, timeout: Optional[float] = None, algo: Optional[str] = None, async_op: bool = False) -> Result:
        """Every rank's x at root (stacked, or 1-D if counts are given); other ranks return None."""
        w = "gather"
        a = as_input(x, w)
        dt = core_dtype(a.dtype)
        n = self.world_size
        root = check_rank(root, n, w, "root")
        if counts is None:
            shape, total = (n,) + a.shape, n * a.size
        else:
            counts = check_counts(counts, n, w)
            if counts[self.rank] != a.size:
                raise InvalidArgumentError(f"{w}: counts[{self.rank}]={counts[self.rank]} but x has {a.size} elements")
            shape, total = (sum(counts),), sum(counts)
        if self.rank != root:
            return self._run(w, a, _empty(a), dt, None, root=root, timeout=timeout, algo=algo, async_op=async_op)
        o = self._out(out, a, total, w, shape)
        return self._run(w, separate(a, o), o, dt, o, root=root, recv_counts=counts, timeout=timeout,
                         algo=algo, async_op=async_op)

    def scatter(self, x: Optional[ArrayLike], root: int, out: ArrayLike, *, counts: Optional[Sequence[int]] = None,
                timeout: Optional[float] = None, algo: Optional[str] = None, async_op: bool = False) -> Result:
        """Block r of root's x goes to out on rank r (x is ignored on other ranks); returns out."""
        w = "scatter"
        n = self.world_size
        root = check_rank(root, n, w, "root")
        o = as_output(out, w)
        dt = core_dtype(o.dtype)
        if counts is not None:
            counts = check_counts(counts, n, w)
            if counts[self.rank] != o.size:
                raise InvalidArgumentError(f"{w}: counts[{self.rank}]={counts[self.rank]} but out has {o.size} elements")
        if self.rank != root:
            return self._run(w, _empty(o), o, dt, o, root=root, timeout=timeout, algo=algo, async_op=async_op)
        a = as_input(x, w)
        total = n * o.size if counts is None else sum(counts)
        check_out(a, o, total, w, name="x")
        return self._run(w, separate(a, o), o, dt, o, root=root, send_counts=counts, timeout=timeout,
                         algo=algo, async_op=async_op)

    def alltoall(self, x: ArrayLike, *, out: Optional[ArrayLike] = None, timeout: Optional[float] = None, algo: Optional[str] = None,
                 async_op: bool = False) -> Result:
        """Block j of x goes to rank j; block i of the result came from rank i."""
        w = "alltoall"
        a = as_input(x, w)
        n = self.world_size
        if a.size % n:
            raise InvalidArgumentError(f"{w}: x has {a.size} elements, not a multiple of world size {n}")
        o = self._out(out, a, a.size, w, a.shape)
        return self._run(w, separate(a, o), o, core_dtype(a.dtype), o, timeout=timeout, algo=algo, async_op=async_op)

    def alltoall_v(self, x: ArrayLike, send_counts: Sequence[int], recv_counts: Sequence[int], *,
                   out: Optional[ArrayLike] = None, timeout: Optional[float] = None, algo: Optional[str] = None, async_op: bool = False) -> Result:
        """Uneven alltoall: send_counts[j] elements of x go to rank j, recv_counts[i] come from rank i."""
        w = "alltoall_v"
        a = as_input(x, w)
        n = self.world_size
        send_counts = check_counts(send_counts, n, w, "send_counts", total=a.size)
        recv_counts = check_counts(recv_counts, n, w, "recv_counts")
        o = self._out(out, a, sum(recv_counts), w, (sum(recv_counts),))
        return self._run("alltoall", separate(a, o), o, core_dtype(a.dtype), o, send_counts=send_counts,
                         recv_counts=recv_counts, timeout=timeout, algo=algo, async_op=async_op)

    def barrier(self, *, timeout: Optional[float] = None, async_op: bool = False) -> Optional[Work]:
        self._prune()
        work = Work(self._comm.barrier(timeout=_timeout(timeout, "barrier"), inline=not async_op), (), None)
        return self._finish(work, async_op)

    # -- point to point --------------------------------------------------------------------------
    def send(self, x: ArrayLike, dst: int, tag: int = 0, *, timeout: Optional[float] = None,
             async_op: bool = False) -> Optional[Work]:
        a = as_input(x, "send")
        dst = self._peer(dst, "send", "dst")
        tag = _tag(tag, "send")
        self._prune()
        w = self._comm.send(addr(a), a.nbytes, core_dtype(a.dtype), dst, tag, timeout=_timeout(timeout, "send"),
                            inline=not async_op)
        return self._finish(Work(w, (a,), None), async_op)

    def recv(self, out: ArrayLike, src: Optional[int] = None, tag: int = 0, *, timeout: Optional[float] = None,
             async_op: bool = False) -> Any:
        """Receives into out; returns the source rank (src=None: from any rank). Async: the Work's
        source() tells the sender."""
        o = as_output(out, "recv")
        src = -1 if src is None else self._peer(src, "recv", "src")
        tag = _tag(tag, "recv")
        self._prune()
        w = self._comm.recv(addr(o), o.nbytes, core_dtype(o.dtype), src, tag, timeout=_timeout(timeout, "recv"),
                            inline=not async_op)
        work = Work(w, (o,), o)
        if async_op:
            return self._finish(work, True)
        self._finish(work, False)
        return work.source()

    # -- lifetime --------------------------------------------------------------------------------
    def abort(self, reason: str = "abort() called") -> None:
        """Ends every in-flight operation (with AbortedError) within about a second; any thread."""
        self._comm.abort(reason)

    def close(self) -> None:
        """Releases threads and sockets. Idempotent."""
        self._comm.close()
        still = []
        for work in self._pending:
            try:
                if not work._work.wait(5.0):
                    still.append(work)
            except Exception:
                pass
        self._pending = still

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------------
    def _out(self, out, like, count, what, shape):
        if out is None:
            return np.empty(shape, dtype=like.dtype)
        o = as_output(out, what)
        check_out(o, like, count, what)
        return o

    def _peer(self, r, what, name):
        r = check_rank(r, self.world_size, what, name)
        if r == self.rank:
            raise InvalidArgumentError(f"{what}: {name}={r} is this rank")
        return r

    def _run(self, coll, send, recv, dtype, result, *, op="sum", factor=None, root=0, send_counts=None,
             recv_counts=None, timeout=None, algo=None, wire=None, async_op=False):
        self._prune()
        w = self._comm.collective(
            coll, addr(send), send.nbytes, addr(recv), recv.nbytes, dtype, op,
            factor=factor, root=root, send_counts=send_counts, recv_counts=recv_counts,
            timeout=_timeout(timeout, coll), algo=algo, inline=not async_op, wire=wire,
        )
        return self._finish(Work(w, (send, recv), result), async_op)

    def _finish(self, work, async_op):
        if async_op:
            self._pending.append(work)
            return work
        try:
            return work._block()
        except BaseException:
            if not work._work.is_completed():  # e.g. Ctrl-C: keep the buffers alive for the core
                self._pending.append(work)
            raise

    def _prune(self):
        if self._pending:
            self._pending = [w for w in self._pending if not w._work.is_completed()]


def _same(a, b):
    """Same memory, same size: the core's definition of in place."""
    return a.nbytes == b.nbytes and addr(a) == addr(b)


def _empty(like):
    return np.empty(0, dtype=like.dtype)


def _int(v, what, name):
    try:
        return operator.index(v)
    except TypeError:
        raise InvalidArgumentError(f"{what}: {name} must be an int, got {v!r}") from None


def _tag(tag, what):
    tag = _int(tag, what, "tag")
    if not 0 <= tag < _core.RESERVED_TAGS:
        raise InvalidArgumentError(f"{what}: tag must be in [0, 2**63) (plait keeps the rest), got {tag}")
    return tag


def _str(v, what, name):
    if not isinstance(v, str):
        raise InvalidArgumentError(f"{what}: {name} must be a str, got {v!r}")
    return v


def _timeout(t, what):
    """Seconds, in the core's range (it names the call and the range otherwise)."""
    return None if t is None else _core.check_argument("timeout", t, what)
