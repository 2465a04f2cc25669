"""torch Work objects for plait operations, and the thread that completes their futures.

`PlaitWork.wait()` blocks inside the core (GIL released) and raises the operation's error. Its
future is made on demand (`get_future()`); a dedicated completion thread per group completes it,
never a thread that moves bytes, so a `.then()` callback may issue another collective. A failed
operation errors the future at the C++ level: the future handed out is `base.then(check)`, and
`check` raises, which is how torch marks a child future failed (setting an exception *value* on a
Python future is not seen by C++ consumers such as DDP's reducer).
"""

import collections
import datetime
import queue
import threading

import torch
import torch.distributed as dist

from .._core import BrokenError, PlaitError, PlaitTimeoutError
from .staging import nbytes
from .trace import end as _trace_end

_POLL = 1.0  # seconds: the longest a Python-side wait blocks before it looks around again

_LEAKED = []  # buffers of ops the core never released (see PlaitWork._settle)
_MIRRORS = {}
_MIRRORS_LOCK = threading.Lock()


def _mirror_class(cls):
    with _MIRRORS_LOCK:
        m = _MIRRORS.get(cls)
        if m is None:
            base = getattr(dist, "DistBackendError", RuntimeError)
            m = type(cls.__name__, (cls, base), {"__module__": "plait.torch", "__doc__": cls.__doc__})
            _MIRRORS[cls] = m
        return m


def torch_error(exc, context=None):
    """`exc` (a plait error) as an instance of a class that is both its plait class and torch's
    DistBackendError (a RuntimeError), so `except RuntimeError`, `except dist.DistBackendError`
    and `except plait.PeerError` all catch it. `context` (e.g. which group and rank) is appended
    to the message."""
    if not isinstance(exc, PlaitError) or isinstance(exc, getattr(dist, "DistBackendError", RuntimeError)):
        return exc
    args = exc.args
    if context and args and isinstance(args[0], str):
        args = (f"{args[0]} [{context}]",) + tuple(args[1:])
    e = _mirror_class(type(exc))(*args)
    e.__cause__ = exc.__cause__
    return e


def seconds(timeout):
    """A torch timeout argument as seconds, or None for "no limit" (None, 0 or negative)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    timeout = float(timeout)
    return timeout if timeout > 0 else None


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


def _check(fut):
    v = fut.value()
    if isinstance(v, _Failure):
        raise v.error
    return v


# C++ can hold a Work that Python code got from a plait method and then dropped: DDP's join
# hands the all_reduce of its forward pass to its reducer, which waits on it and reads its
# result in backward. The C++ side then holds only the C++ base of the Work, whose wait() never
# returns once the Python object, with its overrides, is gone (torch wraps a Work in a holder
# that keeps it alive only when C++ itself called the method). So the newest works with small
# outputs, the ones such control calls make, stay alive for a while after Python drops them:
# at most _RECENT_COUNT of them, of at most _RECENT_BYTES of outputs each.
_RECENT_COUNT = 256
_RECENT_BYTES = 64 << 10
_RECENT = collections.deque(maxlen=_RECENT_COUNT)


class PlaitWork(dist.Work):
    """One torch-level operation: one or more core operations (`parts`), the output tensors, and
    what to do when they end (`finish(ok)`: copy back staged outputs, free staging memory)."""

    def __init__(self, group, parts, outputs, finish=None, what="operation"):
        super().__init__()
        self._group = group
        self._parts = parts
        self._outputs = outputs
        self._finish_cb = finish
        self._what = what
        self._lock = threading.Lock()
        self._settled = False
        self._error = None
        self._future = None
        self._base = None
        self._source = -1
        self._extra = []
        self._extra_threads = []
        self._pl_trace = None  # this op's entry in the group's trace (trace.py), ended at settle
        if sum(nbytes(t) for t in outputs) <= _RECENT_BYTES:
            _RECENT.append(self)

    # -- internals ---------------------------------------------------------------------------

    def _wait_parts(self, timeout):
        """True when every part is done, False if `timeout` (seconds or None) passed first.
        Raises the first part's error."""
        deadline = None if timeout is None else _now() + timeout
        for p in self._parts:
            while True:
                left = _POLL if deadline is None else min(_POLL, deadline - _now())
                if left <= 0:
                    if p.is_completed():
                        p.wait(0.001)
                        break
                    return False
                if p.wait(left):
                    break
        return True

    def _settle(self, error):
        """Runs once: records the outcome and runs the finish callback (copy-back, release of the
        staging memory)."""
        with self._lock:
            if self._settled:
                return
            running = False
            if error is not None:
                # Other parts may still be running in the core: they fail promptly on the broken
                # communicator. Wait for them (bounded) before any buffer is released.
                for p in self._parts:
                    for _ in range(30):
                        try:
                            if p.wait(_POLL):
                                break
                        except BaseException:
                            break
                    running = running or not p.is_completed()
            if running:
                # Still touching our buffers after 30 s: keep them alive for good rather than
                # free memory the core may write to.
                _LEAKED.append((self._parts, self._finish_cb))
            else:
                try:
                    if self._finish_cb is not None:
                        self._finish_cb(error is None)
                except BaseException as e:  # a copy-back failed: that is the op's error
                    if error is None:
                        error = e
            self._error = torch_error(error, self._group.context()) if error is not None else None
            for p in self._parts:
                try:
                    s = p.source()
                    if s >= 0:
                        self._source = s
                except Exception:
                    pass
            self._parts = []
            self._finish_cb = None
            self._settled = True
        if self._extra:
            self._flush_extra()
        entry, self._pl_trace = self._pl_trace, None
        if entry is not None:
            _trace_end(entry, self._error)

    def _settle_if_complete(self):
        if self._settled:
            return True
        parts = self._parts
        if not all(p.is_completed() for p in parts):
            return False
        err = None
        try:
            self._wait_parts(1.0)
        except BaseException as e:
            err = e
        self._settle(err)
        return True

    def _run_to_end(self):
        """Completion thread: wait (bounded steps), settle, complete the future."""
        err = None
        try:
            while not self._wait_parts(_POLL):
                pass
        except BaseException as e:
            err = e
        self._settle(err)
        self._complete_future()

    def _complete_future(self):
        base = self._base
        if base is None or base.done():
            return
        if self._error is not None:
            base.set_result(_Failure(self._error))
        else:
            base.set_result(self._outputs)

    def _end_on_thread(self, fut):
        """Completes `fut` (a profiler event's end) from another thread once the op has ended,
        before wait() returns: an event must end on another thread to count as async, and must
        not end after the caller has left the profiler."""
        with self._lock:
            self._extra.append(fut)
            settled = self._settled
        if settled:
            self._flush_extra()
        else:
            self._group.completer.submit(self)  # settles it even if nobody waits

    def _flush_extra(self):
        with self._lock:
            extra, self._extra = self._extra, []
        if not extra:
            return

        def end():
            for f in extra:
                if not f.done():
                    f.set_result(None)

        t = threading.Thread(target=end, name="plait-profiler-end", daemon=True)
        t.start()
        self._extra_threads.append(t)

    def _join_extra(self):
        for t in self._extra_threads:
            t.join(10.0)
        self._extra_threads = []

    # -- torch API -----------------------------------------------------------------------------

    def wait(self, timeout=None):
        t = seconds(timeout)
        if not self._settled:
            try:
                ok = self._wait_parts(t)
            except BaseException as e:
                self._settle(e)
                self._join_extra()
                raise self._error from None
            if not ok:
                raise torch_error(
                    PlaitTimeoutError(f"plait: {self._what} did not complete within the {t:g} s wait() timeout (it is still in flight)")
                )
            self._settle(None)
        if self._extra_threads:
            self._join_extra()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._settle_if_complete()

    def is_success(self):
        return self._settle_if_complete() and self._error is None

    def exception(self):
        self._settle_if_complete()
        return self._error

    def result(self):
        return list(self._outputs)

    def source_rank(self):
        self._settle_if_complete()
        if self._source < 0:
            raise RuntimeError("plait: source_rank() is only defined for a completed receive from any source")
        return self._source

    def _source_rank(self):
        return self.source_rank()

    def synchronize(self):
        # Outputs are on the host (or copied back synchronously on the issuing stream) by the
        # time the op completes; nothing to order on a device stream.
        return None

    def get_future(self, on_thread=False):
        """The future of this op: its value is the list of output tensors; it is failed (at the
        C++ level) when the op fails. `on_thread`: complete it on the completion thread even if
        the op is already done (profiler events must end on another thread to be async)."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._base = torch.futures.Future()
            self._future = self._base.then(_check)
            settled = self._settled
        if not on_thread and (settled or self._settle_if_complete()):
            self._complete_future()
        else:
            self._group.completer.submit(self)
        return self._future

    def __repr__(self):
        state = "failed" if self._error is not None else ("done" if self._settled else "in flight")
        return f"<plait Work {self._what}: {state}>"

    def __del__(self):
        # Dropped while in flight (an async op nobody waits on): the core is still reading or
        # writing the buffers this Work keeps alive, and outputs may still need copying back.
        # Hand both to the completion thread, which finishes the op as wait() would have.
        try:
            if not self._settled and (self._parts or self._finish_cb is not None):
                self._group.completer.submit(_Orphan(self._parts, self._finish_cb))
        except Exception:
            pass


class Sub:
    """A PlaitWork as a part of another (the Work c10d's coalescing manager waits on)."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self, timeout=None):
        w = self.work
        if w._settled:
            if w._error is not None:
                raise w._error
            return True
        try:
            ok = w._wait_parts(timeout)
        except BaseException as e:
            w._settle(e)
            raise w._error from None
        if ok:
            w._settle(None)
            if w._error is not None:
                raise w._error
        return ok

    def is_completed(self):
        return self.work.is_completed()

    def source(self):
        return -1


class _Orphan:
    """The in-flight remainder of a Work that was garbage collected."""

    __slots__ = ("_parts", "_finish")

    def __init__(self, parts, finish):
        self._parts = parts
        self._finish = finish

    def _run_to_end(self):
        ok = True
        for p in self._parts:
            try:
                while not p.wait(_POLL):
                    pass
            except BaseException:
                ok = False
        if self._finish is not None:
            try:
                self._finish(ok)
            except BaseException:
                pass

    def _settle(self, error):  # Completer.submit after stop
        self._run_to_end()

    def _complete_future(self):
        pass


try:
    from torch._C._distributed_c10d import _create_work_from_future
except ImportError:  # not in every torch build: the Python Work below does the same, slower
    _create_work_from_future = None


def done_work(group, outputs, what):
    """The Work of an operation that has already succeeded: torch's own C++ Work over a completed
    future, a few microseconds against the Python `PlaitWork`'s twenty, and one that C++ can
    hold after Python drops it (see `_RECENT`)."""
    if _create_work_from_future is None:
        return PlaitWork(group, [], outputs, None, what)
    f = torch.futures.Future()
    f.set_result(outputs)
    return _create_work_from_future(f)


def completed_work(group, outputs, what):
    """A Work that is already done (ops with nothing to send)."""
    return PlaitWork(group, [], outputs, None, what)


_STOP = object()


class Completer:
    """The per-group thread that completes futures. Started on first use, joined at shutdown."""

    def __init__(self, name):
        self._name = name
        self._q = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, work):
        with self._lock:
            if self._stopped:
                work._settle(BrokenError("plait: the process group was shut down"))
                work._complete_future()
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"plait-complete-{self._name}", daemon=True)
                self._thread.start()
        self._q.put(work)

    def _run(self):
        while True:
            w = self._q.get()
            if w is _STOP:
                return
            try:
                w._run_to_end()
            except BaseException:  # pragma: no cover - never let this thread die silently
                import traceback

                traceback.print_exc()

    def in_thread(self):
        return self._thread is not None and threading.current_thread() is self._thread

    def stop(self, timeout=30.0):
        """Finishes the queued works (their ops have already failed or ended) and joins."""
        with self._lock:
            self._stopped = True
            t = self._thread
        if t is None:
            return
        self._q.put(_STOP)
        if t is not threading.current_thread():
            t.join(timeout)


def _now():
    import time

    return time.monotonic()


__all__ = ["PlaitWork", "Completer", "Sub", "torch_error", "seconds", "completed_work"]
