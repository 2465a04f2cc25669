"""Parent side of the multi-process tests: start a world of N worker processes on loopback (each runs
`worker.py <cases module>`), optionally steer it (kill or stop a rank), collect each rank's JSON
events, and always kill every process at the end. Every wait here has a deadline."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore import KVServer

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
NOTES = []  # lines printed in pytest's terminal summary (conftest.py)


def note(line):
    """Records a measurement for the end-of-run summary (and prints it, visible with -s)."""
    NOTES.append(line)
    print(line)


class World:
    def __init__(self, cases, n, *, args, env, store):
        self.n = n
        self.dir = Path(tempfile.mkdtemp(prefix=f"plait-{cases}-{n}-"))
        if store == "torch":
            import datetime

            from torch.distributed import TCPStore

            self.store = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                                  wait_for_workers=False)
        else:
            self.store = KVServer()
        self._server = self.store
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.procs = []
        try:
            for r in range(n):
                cmd = [sys.executable, str(WORKER), cases, str(r), str(n), store, str(self.store.port),
                       str(self.events_path(r)), json.dumps(args or {})]
                with open(self.dir / f"{r}.log", "wb") as log:
                    self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                                       cwd=HERE, start_new_session=True))
        except BaseException:
            self.kill_all()
            raise
        self.pids = [p.pid for p in self.procs]

    def events_path(self, r):
        return self.dir / f"{r}.jsonl"

    # -- steering (used by fault tests) --------------------------------------------------------
    def wait_keys(self, keys, timeout):
        import datetime

        self.store.wait(list(keys), datetime.timedelta(seconds=timeout))

    def send_signal(self, rank, sig):
        try:
            os.killpg(self.procs[rank].pid, sig)
        except ProcessLookupError:
            pass

    def wait_ranks(self, ranks, timeout):
        """Waits until the given ranks exit; False if the deadline passed first."""
        deadline = time.monotonic() + timeout
        for r in ranks:
            try:
                self.procs[r].wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    # -- end ------------------------------------------------------------------------------------
    def finish(self, timeout):
        """Waits for every rank (up to timeout), then kills whatever is left. Returns the result."""
        t0 = time.monotonic()
        timed_out = not self.wait_ranks(range(self.n), timeout)
        self.kill_all()
        return WorldResult(self, timed_out, time.monotonic() - t0)

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            self._server.close() if hasattr(self._server, "close") else None
        except Exception:
            pass


class WorldResult:
    def __init__(self, world, timed_out, elapsed):
        self.n = world.n
        self.dir = world.dir
        self.timed_out = timed_out
        self.elapsed = elapsed
        self.returncodes = [p.returncode for p in world.procs]
        self.events = [_read_events(world.events_path(r)) for r in range(world.n)]
        self._cases = None

    def of(self, rank, ev):
        return [e for e in self.events[rank] if e.get("ev") == ev]

    def done(self, rank):
        d = self.of(rank, "done")
        return d[0] if d else None

    def log_tail(self, rank, lines=25):
        try:
            text = (self.dir / f"{rank}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def case_results(self):
        """{case: {rank: None (passed) or the failure message}} over every rank's reports."""
        if self._cases is None:
            self._cases = {}
            for r in range(self.n):
                for e in self.events[r]:
                    if e.get("ev") in ("pass", "fail"):
                        self._cases.setdefault(e["case"], {})[r] = e.get("msg")
        return self._cases

    def problems(self, ranks=None, expect_fail=False, cases=None):
        """Human-readable list of everything that went wrong on the given ranks. With `cases` (the
        planned case names, each checked by its own test): only what lies outside them, i.e. a
        failure outside any case (an aborted section, a rank's crash) or a case not in the plan."""
        out = []
        planned = None if cases is None else set(cases)
        if self.timed_out:
            out.append(f"world did not finish in time (killed); logs in {self.dir}")
        for r in range(self.n) if ranks is None else ranks:
            if not expect_fail:
                for e in self.of(r, "fail"):
                    if planned is None or e["case"] not in planned:
                        out.append(f"rank {r}: {e['case']}: {e['msg']}")
            if planned is not None:
                out += [f"rank {r}: {e['case']}: reported but not in the plan" for e in self.of(r, "pass")
                        if e["case"] not in planned]
            if self.done(r) is None or self.returncodes[r] != 0:
                out.append(f"rank {r}: exit code {self.returncodes[r]}, done={self.done(r) is not None}; "
                           f"log tail:\n{self.log_tail(r)}")
        return out

    def assert_ok(self, ranks=None, limit=40, cases=None):
        problems = self.problems(ranks, cases=cases)
        if problems:
            shown = "\n".join(problems[:limit])
            more = f"\n... and {len(problems) - limit} more" if len(problems) > limit else ""
            raise AssertionError(f"{len(problems)} problem(s) in the {self.n}-rank world:\n{shown}{more}")


def _read_events(path):
    events = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass  # a line cut short by a kill
    except OSError:
        pass
    return events


def run_world(cases, n, *, args=None, env=None, store="py", timeout=300, control=None):
    """Runs `cases` (a module in tests/ with run(ctx)) on n ranks. `control(world)` runs in this
    process while the world is alive. Returns a WorldResult; every process is dead afterwards."""
    world = World(cases, n, args=args, env=env, store=store)
    started = time.monotonic()
    try:
        if control is not None:
            control(world)
        return world.finish(max(1.0, timeout - (time.monotonic() - started)))
    finally:
        world.kill_all()


def listening_ports(pid):
    """TCP ports that process `pid` listens on (from /proc; Linux only)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and parts[9] in inodes:  # 0A = LISTEN
                        ports.add(int(parts[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return sorted(ports)


def assert_same_digests(res):
    """Results each rank hashed (ctx.digests) must be identical on every rank."""
    digests = [(res.done(r) or {}).get("digests", {}) for r in range(res.n)]
    differ = [k for k in digests[0] if any(d.get(k) != digests[0][k] for d in digests[1:])]
    assert not differ, f"results differ between ranks for: {differ[:10]}"


def assert_cases(res, names, planned, limit=20):
    """Every case in `names` passed on every rank. Each failure is named with its rank's message; a
    case a rank never reported fails too, shown with the rank's failures outside the `planned`
    cases (an aborted section, the worker) and its exit."""
    results = res.case_results()
    bad, silent = [], {}
    for name in names:
        got = results.get(name, {})
        failed = {}  # message -> ranks: an identical failure on every rank is told once
        for r in range(res.n):
            if r not in got:
                silent.setdefault(r, []).append(name)
            elif got[r] is not None:
                failed.setdefault(got[r], []).append(r)
        bad += [f"{name}: {_ranks(ranks)}: {msg}" for msg, ranks in failed.items()]
    told = {}  # ranks that missed the same cases for the same reasons are told once
    for r, missing in silent.items():
        why = [f"{e['case']}: {e['msg']}" for e in res.of(r, "fail") if e["case"] not in planned]
        if res.timed_out:
            why.append("the world timed out")
        if res.done(r) is None or res.returncodes[r] != 0:
            why.append(f"exit code {res.returncodes[r]}, done={res.done(r) is not None}; log tail:\n{res.log_tail(r)}")
        told.setdefault((tuple(missing), tuple(why[:3])), []).append(r)
    for (missing, why), ranks in told.items():
        bad.append(f"{_ranks(ranks)} never reported "
                   f"{len(missing)} case(s), first {missing[0]!r}" + "".join(f"\n    {w}" for w in why))
    if bad:
        more = f"\n... and {len(bad) - limit} more" if len(bad) > limit else ""
        raise AssertionError(f"{len(bad)} problem(s) in the {res.n}-rank world:\n" + "\n".join(bad[:limit]) + more)


def _ranks(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class Worlds:
    """Runs each world once, however many tests read it: `get(key)` runs `start(key)` the first
    time and afterwards returns its result, or raises its error again (a world that cannot start
    must not be retried by each of its cases)."""

    def __init__(self, start):
        self.start, self.done = start, {}

    def get(self, key):
        if key not in self.done:
            try:
                self.done[key] = (self.start(key), None)
            except Exception as e:
                self.done[key] = (None, e)
        res, err = self.done[key]
        if err is not None:  # a new error each time: re-raising one object would grow its traceback
            raise RuntimeError(f"world {key!r} did not run: {type(err).__name__}: {err}") from err
        return res


def elastic_group(code, args, *, late=(), timeout=120):
    """Runs the worker script `code` once per entry of `args` (its argv): the first process founds
    an elastic group, the others join it through its contact (PLAIT_JOIN). Each process's first
    stdout line is a JSON object with its "contact". The entries of `late` start once every
    earlier process has printed that line. Returns every process's JSON lines after the first,
    in start order; each process must exit 0 (a crash on purpose is `os._exit(0)`). Every
    process is killed at the end, whatever happened."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    env.pop("PLAIT_JOIN_STORE", None)

    def start(argv, contact=None):
        e = dict(env, PLAIT_JOIN=contact) if contact else env
        return subprocess.Popen([sys.executable, "-c", code, *map(str, argv)], env=e, stdout=subprocess.PIPE, text=True)

    procs = [start(args[0])]
    try:
        contact = json.loads(procs[0].stdout.readline())["contact"]
        procs += [start(a, contact) for a in args[1:]]
        for p in procs[1:]:
            p.stdout.readline()
        procs += [start(a, contact) for a in late]
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, out
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            results.append(lines[1:] if p in procs[len(args):] else lines)
        return results
    finally:
        for p in procs:
            p.kill()
