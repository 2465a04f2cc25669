"""Child side of the multi-process tests: `python worker.py <cases> <rank> <n> <store> <port> <events> <args>`.
Connects to the parent's store, runs `<cases>.run(ctx)` and writes JSON events (one per line):
{"ev": "pass", "case"}, {"ev": "fail", "case", "msg"}, {"ev": "metric", ...}, and finally
{"ev": "done", ...}."""

import datetime
import importlib
import json
import os
import sys
import time
import traceback

import plan


class Ctx:
    """What a cases module gets: rank, n, args, the store, a reporter and communicator helpers."""

    def __init__(self, rank, n, store, events, args):
        self.rank, self.n, self.store, self.args = rank, n, store, args
        self._events = events
        self.epoch = -1
        self.comm = None
        self.cases = 0
        self.failures = 0
        self.digests = {}

    # -- reporting ------------------------------------------------------------------------------
    def emit(self, ev, **kw):
        self._events.write(json.dumps(dict(kw, ev=ev, rank=self.rank, t=time.time())) + "\n")
        self._events.flush()

    def fail(self, case, msg):
        self.failures += 1
        if self.failures > 200:  # enough to diagnose, not enough to drown the report; still named
            msg = "(message dropped: more than 200 failures on this rank)"
        self.emit("fail", case=case, msg=str(msg)[:2000])

    def check(self, case, problem):
        """Counts and reports a case by name; `problem` is None (pass) or a message."""
        self.cases += 1
        if problem:
            self.fail(case, problem)
        else:
            self.emit("pass", case=case)

    def run_cases(self, cases):
        """Runs plan.Case objects in order, each reported under its planned name. An exception
        propagates: the rest of the cases go unreported, which the parent counts as failures."""
        for case in cases:
            self.check(case.name, case.run(self))

    def metric(self, name, **values):
        self.emit("metric", name=name, **values)

    # -- communicators --------------------------------------------------------------------------
    def new_comm(self, *, rank=None, n=None, **kw):
        """Closes the current communicator and builds the next epoch."""
        import plait

        if self.comm is not None:
            self.comm.close()
        self.epoch += 1
        self.comm = plait.Communicator(self.store, self.rank if rank is None else rank, self.n if n is None else n,
                                       epoch=self.epoch, **kw)
        return self.comm

    def sync(self, name, flag=False, timeout=120):
        """Store barrier; returns True if any rank passed flag=True."""
        self.store.set(f"sync/{name}/{self.rank}", b"1" if flag else b"0")
        keys = [f"sync/{name}/{r}" for r in range(self.n)]
        self.store.wait(keys, datetime.timedelta(seconds=timeout))
        return any(self.store.get(k) == b"1" for k in keys)

    def sections(self, sections, **comm_kw):
        """Runs (name, cases) in order, the sections PLAIT_TEST_SECTIONS names (e.g.
        "allreduce,p2p" while debugging) or all. An exception ends the section on that rank; after
        every section all ranks meet in the store and rebuild the communicator if any rank raised."""
        if self.comm is None:
            self.new_comm(**comm_kw)
        for name, cases in plan.selected(sections):
            raised = False
            try:
                self.run_cases(cases)
            except Exception as e:
                self.fail(f"{name} (section aborted)", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
                raised = True
            if self.sync(name, raised):
                self.new_comm(**comm_kw)


def connect(kind, port):
    if kind == "torch":
        from torch.distributed import TCPStore

        return TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=120))
    from kvstore import KVClient

    return KVClient(port)


def main():
    cases, rank, n, store_kind, port, events_path, args = sys.argv[1:8]
    rank, n = int(rank), int(n)
    with open(events_path, "w") as events:
        ctx = Ctx(rank, n, connect(store_kind, int(port)), events, json.loads(args))
        t0 = time.monotonic()
        code = 0
        try:
            importlib.import_module(cases).run(ctx)
        except BaseException as e:
            ctx.fail("worker", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            code = 1
        try:
            if ctx.comm is not None:
                ctx.comm.close()
        except Exception as e:
            ctx.fail("close", f"{type(e).__name__}: {e}")
            code = 1
        ctx.emit("done", cases=ctx.cases, failures=ctx.failures, digests=ctx.digests,
                 seconds=round(time.monotonic() - t0, 3), pid=os.getpid())
    sys.exit(code)


if __name__ == "__main__":
    main()
