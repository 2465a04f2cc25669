"""Point-to-point lanes: ordered send/recv queues, one per (direction, peer, tag).

Messages between two ranks with one tag must match in call order. Each lane runs its operations
one at a time, in call order, on its own thread (the core call blocks with the GIL released), so
receives from different peers never wait on each other and a pending receive never delays a
collective. A small send on an idle lane runs on the caller's thread instead (it only has to
reach the socket: the receiver stashes early messages).
"""

import collections
import threading

from .._core import BrokenError
from .work import Done

_IDLE_EXIT = 30.0  # seconds a lane thread lingers without work before it exits


class Lane:
    def __init__(self, name):
        self._name = name
        self._q = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._thread = None
        self._stopped = False

    def run(self, fn, try_inline):
        """Runs `fn()` (a blocking core call returning the peer rank) in lane order; returns a
        Done that completes with its outcome."""
        done = Done()
        with self._cv:
            if self._stopped:
                done.set(BrokenError("plait: the process group was shut down"))
                return done
            inline = try_inline and not self._busy and not self._q
            if inline:
                self._busy = True
            else:
                self._q.append((fn, done))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name=f"plait-{self._name}", daemon=True)
                    self._thread.start()
                self._cv.notify()
        if inline:
            try:
                _call(fn, done)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify()
        return done

    def _loop(self):
        while True:
            with self._cv:
                while (self._busy or not self._q) and not self._stopped:
                    if not self._cv.wait(_IDLE_EXIT) and not self._q and not self._busy:
                        self._thread = None  # nothing to do for a while: exit; restarted on demand
                        return
                if self._stopped and not self._q:
                    self._thread = None
                    return
                fn, done = self._q.popleft()
                self._busy = True
            try:
                _call(fn, done)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def stop(self, timeout):
        """Fails what is queued (the communicator is closed by now, so what runs fails fast)
        and joins the thread."""
        with self._cv:
            self._stopped = True
            pending = list(self._q)
            self._q.clear()
            t = self._thread
            self._cv.notify_all()
        for _fn, done in pending:
            done.set(BrokenError("plait: the process group was shut down before this operation started"))
        if t is not None and t is not threading.current_thread():
            t.join(timeout)


def _call(fn, done):
    try:
        src = fn()
    except BaseException as e:
        done.set(e)
    else:
        done.set(None, src)


class Lanes:
    def __init__(self, name):
        self._name = name
        self._lanes = {}
        self._lock = threading.Lock()
        self._stopped = False

    def get(self, kind, peer, tag):
        key = (kind, peer, tag)
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = Lane(f"{self._name}-{kind}-{'any' if peer < 0 else peer}-t{tag}")
                if self._stopped:
                    lane._stopped = True
                self._lanes[key] = lane
            return lane

    def stop(self, timeout=30.0):
        with self._lock:
            self._stopped = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.stop(timeout)
