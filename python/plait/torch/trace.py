"""The trace of every plait torch group: its last N operations (PLAIT_TRACE_ENTRIES, default
2000; 0: off), written to a file per rank when an operation times out or fails.

Each c10d call that reaches the core becomes an `Entry` (`Recorder.begin`, from `engine.issue` and
the small-allreduce path): the call as torch names it, its sequence number in the group, tensor
sizes and dtypes, root or peer, reduce op, timeout, and its state (scheduled, started, completed,
failed) with the times it changed. Sizes and dtypes are kept as torch hands them (tuples, dtype
objects) and only turned into text when a trace is written, so recording costs a few object
allocations per call.

On a failure that is the communication's (a timeout, a peer's error, an abort, a mismatch; not a
refused argument) the rank writes every live group's trace to PLAIT_TRACE_DIR (default
`<temp dir>/plait-trace`), names the file in the error, and sets a key in torch's default store;
every other rank polls that key once a second (the way torch's NCCL backend spreads its dump
signal) and writes its own trace too, so the rank that never arrived, which has no error of its
own, leaves its trace as well. Two files per rank:

- `plait_trace_rank_<R>.json`: plait's own form, read by `plait trace show DIR`;
- `plait_fr_rank_<R>`: torch's flight-recorder dump (a pickle of version, pg_config, entries),
  read by `python -m torch.distributed.flight_recorder.fr_trace DIR` (torchfrtrace).

torch 2.15 offers no way for a backend written in Python to feed torch's own flight recorder: its
`FlightRecorderHook` sits in the C++ dispatch of ProcessGroup, which plait's Python overrides
bypass, and `_dump_fr_trace` only reads what C++ backends recorded. So plait writes the same
format itself.
"""

import collections
import itertools
import json
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import weakref

from .. import _core

FR_VERSION = "2.10"  # the flight-recorder dump version whose fields these entries carry
STORE_KEY = "plait/trace/dump"  # set in torch's default store by a rank whose operation failed
POLL_SECONDS = 1.0  # how often a rank looks for that key

# c10d call names (engine.issue's `what`) as torch's flight recorder spells them.
_FR_NAMES = {
    "all_reduce_coalesced": "allreduce_coalesced",
    "all_gather_into_tensor": "_all_gather_base",
    "all_gather_coalesced": "allgather_coalesced",
    "gather_into_tensor": "gather",
    "reduce_scatter_tensor": "_reduce_scatter_base",
}

# Failures that are the communication's: they dump. Argument errors (found before anything is
# sent, on the rank that made them) do not.
_DUMPS = tuple(getattr(_core, n) for n in ("PlaitTimeoutError", "PeerError", "AbortedError", "MismatchError", "BrokenError"))

_lock = threading.Lock()
_recorders = []  # live Recorders, oldest first
_watcher = None
_dumping = threading.Lock()
_again = False
_last_paths = None


def entries_setting():
    v = _core.setting("PLAIT_TRACE_ENTRIES")
    return 2000 if v is None else int(_core.check_setting("PLAIT_TRACE_ENTRIES", v))


def trace_dir():
    return _core.setting("PLAIT_TRACE_DIR") or os.path.join(tempfile.gettempdir(), "plait-trace")


def job_id():
    """What tells one job's traces from another's in the same directory."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return run
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else ""


# An entry is a list, the cheapest object to make on the calling path; `Entry` reads one.
_REC, _ID, _CREATED, _WHAT, _OPTS, _INS, _OUTS, _SEQ, _P2P, _STATE, _STARTED, _ENDED, _ERROR = range(13)


def started(e, work):
    """Entry `e`'s core operations have all been started; `work` (a PlaitWork) ends it when it
    settles (work.py calls `end`)."""
    e[_STARTED] = time.time_ns()
    e[_STATE] = "started"
    work._pl_trace = e
    if work._settled and work._pl_trace is e:  # settled meanwhile on another thread
        work._pl_trace = None
        end(e, work._error)


def running(e):
    """Entry `e`'s operation has started and runs on the calling thread (a small blocking call);
    `done` or `end` ends it."""
    e[_STARTED] = time.time_ns()
    e[_STATE] = "started"


def done(e):
    """Entry `e`, started by `running`, completed."""
    e[_ENDED] = time.time_ns()
    e[_STATE] = "completed"


def end(e, error=None):
    """Entry `e` completed, or failed with `error`: a failure that is the communication's writes
    every rank's trace, and the error's message says where."""
    if e[_ENDED] is not None:
        return
    e[_ENDED] = time.time_ns()
    if error is None:
        e[_STATE] = "completed"
        return
    e[_STATE] = "failed"
    e[_ERROR] = f"{type(error).__name__}: {error}"
    if isinstance(error, _DUMPS):
        paths = dump(f"{Entry(e).describe()} failed: {e[_ERROR]}", signal=True)
        if paths and error.args and isinstance(error.args[0], str) and "plait trace" not in error.args[0]:
            error.args = (f"{error.args[0]} (every group's last operations: {paths[0]}; every rank writes "
                          f"its own there: `plait trace show {os.path.dirname(paths[0])}`)",) + tuple(error.args[1:])


class Entry:
    """One c10d call of a group, read from its list."""

    __slots__ = ("e",)

    def __init__(self, e):
        self.e = e

    @property
    def p2p(self):
        return self.e[_WHAT][:4] in ("send", "recv")

    @property
    def name(self):
        w = self.e[_WHAT]
        return w.split()[0] if self.p2p else w

    @property
    def peer(self):
        """The peer's rank in the group (-1: any source), None for a collective."""
        if not self.p2p:
            return None
        last = self.e[_WHAT].split()[-1]
        return int(last) if last.isdigit() else -1

    def describe(self):
        e = self.e
        return f"{self.name} #{e[_P2P] if self.p2p else e[_SEQ]} of group {e[_REC].group_id!r}"

    def as_dict(self):
        e = self.e
        r, opts, ins = e[_REC], e[_OPTS], e[_INS]
        outs = ins if e[_OUTS] is None else e[_OUTS]
        timeout = _seconds(getattr(opts, "timeout", None), r.timeout)
        created, ended = e[_CREATED], e[_ENDED]
        return {
            "record_id": e[_ID],
            "collective_seq_id": e[_SEQ],
            "p2p_seq_id": e[_P2P],
            "op": self.name,
            "is_p2p": self.p2p,
            "peer": self.peer,
            "root": getattr(opts, "rootRank", None),
            "reduce_op": _op_name(getattr(opts, "reduceOp", None)),
            "input_sizes": [list(s) for s, _ in ins],
            "input_dtypes": [_dtype(d) for _, d in ins],
            "output_sizes": [list(s) for s, _ in outs],
            "output_dtypes": [_dtype(d) for _, d in outs],
            "state": e[_STATE],
            "time_created_ns": created,
            "time_started_ns": e[_STARTED],
            "time_ended_ns": ended,
            "duration_ms": (ended - created) / 1e6 if ended is not None else None,
            "timeout_ms": int((timeout or 0) * 1000),
            "error": e[_ERROR],
            "group": r.group_id,
        }


def _dtype(d):
    s = str(d)
    return s[6:] if s.startswith("torch.") else s


def _tensors(ts):
    try:
        if len(ts) == 1:
            t = ts[0]
            return ((t.shape, t.dtype),)
        return [(t.shape, t.dtype) for t in ts]
    except AttributeError:  # not only tensors
        return [(t.shape, t.dtype) for t in ts if hasattr(t, "shape")]


class Recorder:
    """The last `n` calls of one group (`engine.Group`)."""

    def __init__(self, g, n):
        self.group_id = str(g.group_id)
        self.rank, self.size = g.rank, g.size
        self.global_ranks = list(g.global_ranks)
        self.timeout = g.opts.timeout
        self._owner = lambda: g.owner() if g.owner is not None else None  # the torch object (name, desc)
        self.entries = collections.deque(maxlen=n)
        self._ids = itertools.count()
        self._colls = itertools.count(1)  # next() is atomic: no lock on the calling path
        self._p2ps = itertools.count(1)
        self.seq = 0  # collectives so far
        self.p2p_seq = 0
        self.closed = False

    def begin(self, what, opts, inputs, outputs):
        """A call about to be made: `what` its c10d name ("all_reduce", "send to rank 2"...),
        `opts` torch's options object (read only when the trace is written). Sizes and dtypes
        are taken now; the tensors are not kept. Returns the entry, for `started` and `end`."""
        if what[:4] in ("send", "recv"):
            p2p = self.p2p_seq = next(self._p2ps)
            seq = self.seq
        else:
            seq = self.seq = next(self._colls)
            p2p = self.p2p_seq
        e = [self, next(self._ids), time.time_ns(), what, opts, _tensors(inputs),
             None if outputs is inputs else _tensors(outputs), seq, p2p, "scheduled", None, None, None]
        self.entries.append(e)
        return e

    def name_desc(self):
        pg = self._owner()
        name = getattr(pg, "_pl_name", None) or self.group_id
        desc = getattr(pg, "_pl_desc", None) or "undefined"
        return str(name), str(desc)

    def snapshot(self):
        """(group facts, entries as dicts), oldest entry first."""
        name, desc = self.name_desc()
        out = []
        for e in list(self.entries):
            out.append(Entry(e).as_dict())
        facts = {"name": name, "desc": desc, "id": self.group_id, "ranks": self.global_ranks, "rank": self.rank,
                 "size": self.size, "global_rank": self.global_ranks[self.rank] if self.global_ranks else self.rank,
                 "collectives": self.seq, "p2p": self.p2p_seq, "closed": self.closed}
        return facts, out


def _op_name(op):
    if op is None:
        return None
    inner = getattr(op, "op", op)
    s = str(getattr(inner, "name", inner))
    return s.split(".")[-1].lower()


def _seconds(t, default):
    if t is None:
        return default
    try:
        s = t.total_seconds() if hasattr(t, "total_seconds") else float(t)
    except Exception:
        return default
    return s if s > 0 else default


def recorder_for(g):
    """The group's Recorder, or None when PLAIT_TRACE_ENTRIES is 0."""
    n = entries_setting()
    if n == 0:
        return None
    rec = Recorder(g, n)
    with _lock:
        _recorders.append(rec)
    _ensure_watcher()
    return rec


def forget(rec):
    """A group was shut down cleanly: its trace is no longer written."""
    rec.closed = True
    with _lock:
        if rec in _recorders:
            _recorders.remove(rec)
        last = not _recorders
    if last:
        _stop_watcher()


# -- writing a trace ---------------------------------------------------------------------------


def _global_rank():
    with _lock:
        recs = list(_recorders)
    for r in recs:
        if r.global_ranks:
            return r.global_ranks[r.rank]
    return int(os.environ.get("RANK", "0"))


def document(reason):
    """This rank's trace: every live group's facts and entries."""
    with _lock:
        recs = list(_recorders)
    groups = []
    for r in recs:
        facts, entries = r.snapshot()
        facts["entries"] = entries
        groups.append(facts)
    return {
        "plait_trace": 1,
        "rank": _global_rank(),
        "job": job_id(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time_ns": time.time_ns(),
        "reason": reason,
        "plait_version": getattr(_core, "__version__", ""),
        "groups": groups,
    }


def flight_recorder(doc):
    """`doc` in torch's flight-recorder dump format (what `fr_trace` loads)."""
    pg_config, pg_status, entries = {}, {}, []
    for g in doc["groups"]:
        pg_config[g["name"]] = {"name": g["name"], "desc": g["desc"], "ranks": str(list(g["ranks"]))}
        last_started = max((e["collective_seq_id"] for e in g["entries"] if not e["is_p2p"]), default=-1)
        last_done = max((e["collective_seq_id"] for e in g["entries"] if not e["is_p2p"] and e["state"] == "completed"), default=-1)
        pg_status[g["name"]] = {"last_enqueued_collective": g["collectives"], "last_started_collective": last_started,
                                "last_completed_collective": last_done}
        for e in g["entries"]:
            if e["is_p2p"]:
                me = g["rank"]
                peer = "?" if e["peer"] is None or e["peer"] < 0 else e["peer"]
                name = f"send {me}->{peer}" if e["op"] == "send" else f"recv {me}<-{peer}"
            else:
                name = _FR_NAMES.get(e["op"], e["op"])
            entries.append({
                "record_id": e["record_id"],
                "pg_id": g["id"],
                "process_group": (g["name"], g["desc"]),
                "collective_seq_id": e["collective_seq_id"] if not e["is_p2p"] else 0,
                "p2p_seq_id": e["p2p_seq_id"] if e["is_p2p"] else 0,
                "op_id": e["record_id"],
                "profiling_name": f"plait:{name}",
                "time_created_ns": e["time_created_ns"],
                "duration_ms": e["duration_ms"],
                "input_sizes": e["input_sizes"],
                "input_dtypes": [_FR_DTYPES.get(d, d) for d in e["input_dtypes"]],
                "output_sizes": e["output_sizes"],
                "output_dtypes": [_FR_DTYPES.get(d, d) for d in e["output_dtypes"]],
                # the flight recorder knows scheduled, started and completed; a failed op never completed
                "state": "started" if e["state"] == "failed" else e["state"],
                "time_discovered_started_ns": e["time_started_ns"],
                "time_discovered_completed_ns": e["time_ended_ns"] if e["state"] == "completed" else None,
                "retired": e["state"] in ("completed", "failed"),
                "timeout_ms": e["timeout_ms"],
                "is_p2p": e["is_p2p"],
                "frames": [],
            })
    entries.sort(key=lambda e: e["time_created_ns"])
    return {"version": FR_VERSION, "pg_config": pg_config, "pg_status": pg_status, "entries": entries,
            "comm_lib_version": f"plait {doc.get('plait_version', '')}"}


# ScalarType names, as the C++ flight recorder writes dtypes
_FR_DTYPES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int8": "Char",
              "uint8": "Byte", "int16": "Short", "int32": "Int", "int64": "Long", "bool": "Bool",
              "uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64", "complex64": "ComplexFloat",
              "complex128": "ComplexDouble"}


def _write(path, data):
    d = os.path.dirname(path)
    tmp = os.path.join(d, f"tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def dump(reason, signal=False, directory=None):
    """Writes this rank's trace (JSON and flight-recorder form); returns the two paths, or None
    when there is nothing to write or writing failed. `signal`: also ask every other rank to
    write theirs. Concurrent failures are written once, by the first thread, after the others."""
    global _again, _last_paths
    if signal:
        _signal_others(reason)
    if not _dumping.acquire(blocking=False):
        _again = True
        return _last_paths
    try:
        while True:
            _again = False
            paths = _dump_once(reason, directory)
            if paths is not None:
                _last_paths = paths
            if not _again:
                return paths
    finally:
        _dumping.release()


def _dump_once(reason, directory=None):
    doc = document(reason)
    if not doc["groups"]:
        return None
    d = directory or trace_dir()
    rank = doc["rank"]
    try:
        os.makedirs(d, exist_ok=True)
        jpath = os.path.join(d, f"plait_trace_rank_{rank}.json")
        fpath = os.path.join(d, f"plait_fr_rank_{rank}")
        _write(jpath, json.dumps(doc, indent=1).encode())
        _write(fpath, pickle.dumps(flight_recorder(doc)))
    except OSError as e:
        print(f"plait: rank {rank} could not write its trace to {d}: {e}", file=sys.stderr, flush=True)
        return None
    why = reason if len(reason) <= 160 else reason[:157] + "..."
    print(f"plait: rank {rank} wrote its trace to {jpath} ({why}); see `plait trace show {d}`", file=sys.stderr, flush=True)
    return jpath, fpath


# -- telling the other ranks -------------------------------------------------------------------


def _default_store():
    try:
        from torch.distributed import distributed_c10d as c10d

        if not c10d.is_initialized():
            return None
        return c10d._get_default_store()
    except Exception:
        return None


def _signal_others(reason):
    store = _default_store()
    if store is None:
        return
    try:
        store.set(STORE_KEY, json.dumps({"rank": _global_rank(), "time_ns": time.time_ns(), "reason": reason}))
    except Exception:
        pass


class _Watcher:
    """Polls torch's default store for another rank's failure and writes this rank's trace."""

    def __init__(self):
        self.stop = threading.Event()
        self.seen = None
        self.baseline = False
        self.thread = threading.Thread(target=self.run, name="plait-trace-watch", daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.wait(POLL_SECONDS):
            store = _default_store()
            if store is None:
                continue
            try:
                if not store.check([STORE_KEY]):
                    self.baseline = True
                    continue
                v = bytes(store.get(STORE_KEY))
            except Exception:
                continue
            if not self.baseline:  # there before this process started watching: an earlier job's
                self.baseline, self.seen = True, v
                continue
            if v == self.seen or self.stop.is_set():
                continue
            self.seen = v
            try:
                info = json.loads(v)
            except ValueError:
                info = {}
            if info.get("rank") == _global_rank():
                continue
            dump(f"rank {info.get('rank', '?')} reported a failure: {info.get('reason', '')}")


def _ensure_watcher():
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = _Watcher()


def _stop_watcher():
    global _watcher
    with _lock:
        w, _watcher = _watcher, None
    if w is not None:
        w.stop.set()
        if w.thread is not threading.current_thread():
            w.thread.join(5.0)


__all__ = ["Recorder", "Entry", "started", "end", "recorder_for", "forget", "dump", "document", "flight_recorder", "trace_dir"]
