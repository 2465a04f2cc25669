"""`plait testbed churn`: elastic members on this machine run a workload while a chaos driver
kills (-9), stops (SIGSTOP, then SIGCONT) or starts members, and, with `--netns` (each member in
its own network namespace of a testbed), cuts the network between two halves of the group for a
while (a partition).

Workload `allreduce` (the default): allreduces on deterministic inputs. Every member checks every
result it returns against the sum of the inputs of the members of the view it ran in (an input is
a function of the member, the epoch and the operation's index in it), and logs one JSON line per
event. The driver reads the logs and reports: operations committed, failed (PeerLost) and wrong
(must be 0), the time from each kill or stop to the next committed operation (p50, p99), and the
longest stall.

Workload `diloco`: every member trains a small model (16-64-4 MLP, its own random batches of a
fixed teacher) with `plait.diloco.DiLoCo`, one inner step every `pace` seconds, H inner steps per
round. Members are forked by one parent that imported torch and plait and built an optimizer once
(`diloco_zygote_main`), so a replacement starts and joins within milliseconds, mid-run, and costs
the machine no import. Two more actions kill a member inside an outer average (`kill-mid-average`,
`kill-leader-mid-average`: the driver asks, and at its next average the member dies as it arrives
there or on a timer inside the allreduce; not if its view has shrunk below 3 meanwhile). The driver
acts only while the group's view (from the members' logs) has 3 members or more, so that a majority
survives every single loss. When the chaos time is over it stops acting, lets stopped members
resume (they are evicted and exit), refills the group with joiners and lets them in, then writes
the end step (a few rounds ahead of the group, on a round boundary; with `diloco_steps`, that count
from the start), which every member reads before reaching it: all stop at the same inner step of
the group's shared counter. Each survivor then logs a hash of its outer state
(`SharedState.chunk_hashes()`: outer parameters, momentum, pending average, counters), its rounds,
inner steps and view size, and exits. The report: rounds, survivors, distinct final hashes (must be
1), errors (an exception in a member, a survivor that did not finish), kills (how many landed
inside an average), stops, joins, the time from each action to the next round completed, and the
longest stall between rounds.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ELEMENTS = 1024  # per allreduce: small, so the churn and not the data dominates


def _inputs(member: str, epoch: int, index: int):
    import numpy as np

    base = (int(member, 16) % 997) + epoch * 1000 + index
    return np.arange(ELEMENTS, dtype=np.float64) * 0.5 + base


def _join_logged(peers: List[str], listen: str, hb: float, emit):
    """Joins (or founds) the group, logging it; None if joining failed (logged)."""
    import plait
    import plait.elastic

    emit(event="joining")
    try:
        comm = plait.elastic.join(peers, listen=listen, heartbeat_timeout=hb, timeout=max(30.0, 10 * hb))
    except plait.PlaitError as e:
        emit(event="join_failed", error=str(e))
        return None
    emit(event="joined", id=comm.member_id, contact=comm.contact, epoch=comm.epoch, world=comm.world_size, pid=os.getpid())
    return comm


def member_main(argv: List[str]) -> int:
    """One member: `python -m plait.tools.testbed.churn member LOG STOPFILE HB LISTEN [PEER...]`."""
    import numpy as np

    import plait
    import plait.elastic

    log_path, stop_file, hb, listen, peers = argv[0], argv[1], float(argv[2]), argv[3], argv[4:]
    log = open(log_path, "a", buffering=1)

    def emit(**event):
        event["t"] = time.time()
        log.write(json.dumps(event) + "\n")

    comm = _join_logged(peers, listen, hb, emit)
    if comm is None:
        return 1
    index: Dict[int, int] = {}
    try:
        while not os.path.exists(stop_file):
            comm.update()
            epoch, members = comm.epoch, comm.members
            i = index.get(epoch, 0)
            index[epoch] = i + 1
            x = _inputs(comm.member_id, epoch, i)
            start = time.time()
            try:
                comm.allreduce(x, out=x)
            except plait.PeerLost as e:
                # It did not run in `epoch` (it was the old epoch's, failed everywhere), or the
                # group left `epoch`: either way it takes no index there.
                index[epoch] = i
                emit(event="lost", epoch=epoch, index=i, start=start, error=str(e))
                continue
            expected = sum(_inputs(m, epoch, i) for m in members)
            ok = bool(np.array_equal(x, expected))
            emit(event="ok" if ok else "wrong", epoch=epoch, index=i, members=len(members), start=start)
    except plait.EvictedError as e:
        emit(event="evicted", error=str(e))
        return 0
    except plait.PlaitError as e:
        emit(event="error", error=f"{type(e).__name__}: {e}")
        return 1
    comm.close()
    emit(event="left")
    return 0


def _mlp():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def diloco_zygote_main(argv: List[str]) -> int:
    """The DiLoCo members' parent: `python -m plait.tools.testbed.churn diloco-zygote`. It imports
    torch and plait and warms up once (torch's first optimizer imports torch._dynamo: about a
    second), then forks one member per request line on stdin ({"log", "err", "listen", "peers",
    "config", "hb"}), answering "forked PID" on stdout, and "exit PID CODE" when a member ends (it
    reaps them). A member so starts in milliseconds, and a joiner joins mid-run at once."""
    import torch

    torch.set_num_threads(1)  # a few members share the machine's cores

    import plait.diloco  # noqa: F401  (imported once, here)
    import plait.elastic  # noqa: F401

    warm = _mlp()
    opt = torch.optim.AdamW(warm.parameters(), lr=1e-3)
    torch.nn.functional.mse_loss(warm(torch.randn(2, 16)), torch.zeros(2, 4)).backward()
    opt.step()

    def say(line: str):
        os.write(1, (line + "\n").encode())  # unbuffered: the SIGCHLD handler writes too

    def reap(signum, frame):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")

    signal.signal(signal.SIGCHLD, reap)
    say("ready")
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)
                os.dup2(null, 1)
                err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(err, 2)
                sys.stdin = open(os.devnull)
                code = _diloco_member(req["log"], json.loads(Path(req["config"]).read_text()), float(req["hb"]),
                                      req["listen"], req["peers"])
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)  # its log is written line by line; nothing else to tear down
        say(f"forked {pid}")
    return 0


def _diloco_member(log_path: str, cfg: dict, hb: float, listen: str, peers: List[str]) -> int:
    """One DiLoCo member (forked by the zygote): joins `peers` (founds the group if none), trains
    until the end step the driver writes, logs its final outer state's hash."""
    import hashlib
    import threading
    import traceback

    import torch

    import plait
    import plait.elastic
    from plait.diloco import DiLoCo

    log = open(log_path, "a", buffering=1)
    lock = threading.Lock()  # an async average's thread logs too (kill-mid-average)

    def emit(**event):
        event["t"] = time.time()
        with lock:
            log.write(json.dumps(event) + "\n")

    torch.manual_seed(0)  # the same initial weights and teacher everywhere (a joiner takes the group's anyway)
    model = _mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=float(cfg.get("lr", 1e-3)))
    teacher = torch.randn(16, 4)
    probe = torch.randn(256, 16)
    comm = _join_logged(peers, listen, hb, emit)
    if comm is None:
        return 1
    _arm_kill_mid_average(comm, Path(cfg["die_dir"]) / comm.member_id, emit)
    end_file = Path(cfg["end_file"])
    gen = torch.Generator().manual_seed(int(comm.member_id[-8:], 16))  # each member its own batches
    try:
        diloco = DiLoCo(model, inner, comm, every=int(cfg["every"]), wire=cfg["wire"], mode=cfg["mode"],
                        fragments=int(cfg["fragments"]))
        end: Optional[int] = None
        rounds = 0
        seen = [comm.epoch]

        def view():  # the driver acts only while the group's view has 3 members or more
            if comm.epoch != seen[0]:
                seen[0] = comm.epoch
                emit(event="view", epoch=comm.epoch, world=comm.world_size, steps=diloco.inner_steps)

        while end is None or diloco.inner_steps < end:
            if end is None and end_file.exists():
                end = int(end_file.read_text())
                if diloco.inner_steps > end:  # read too late: this member cannot stop where the others do
                    emit(event="error", error=f"member {comm.member_id} read the end step {end} at inner step "
                                              f"{diloco.inner_steps}, past it")
                    return 1
                continue
            diloco.update()
            view()
            x = torch.randn(32, 16, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), x @ teacher)
            loss.backward()
            diloco.step()
            diloco.zero_grad()
            view()
            if diloco.rounds != rounds:
                rounds = diloco.rounds
                emit(event="round", rounds=rounds, steps=diloco.inner_steps, epoch=comm.epoch, world=comm.world_size,
                     loss=loss.item())
            if cfg["pace"]:
                time.sleep(cfg["pace"])
        diloco.finish()
        digest = hashlib.sha256(diloco.state.chunk_hashes()).hexdigest()
        with torch.no_grad():
            # The shared model is the outer parameters (in streaming mode each member's own
            # parameters are some inner steps past them, except the fragment synced last).
            local_is_outer = bool(torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), diloco.outer))
            shared = _mlp()
            torch.nn.utils.vector_to_parameters(diloco.outer.clone(), shared.parameters())
            probe_loss = float(torch.nn.functional.mse_loss(shared(probe), probe @ teacher))
        emit(event="done", hash=digest, rounds=diloco.rounds, steps=diloco.inner_steps, epoch=comm.epoch,
             world=comm.world_size, members=comm.members, probe_loss=probe_loss, local_is_outer=local_is_outer,
             bytes=diloco.bytes_sent)
        comm.barrier()  # no member exits before every one has read the view it ended in
    except plait.EvictedError as e:
        emit(event="evicted", error=str(e))
        return 0
    except Exception as e:  # PeerLost included: DiLoCo is to handle it
        emit(event="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return 1
    # No comm.close(): every member ends at once, and leaves voted all at once cannot be agreed
    # (each would wait two heartbeat timeouts); the group ends with its processes.
    emit(event="left")
    return 0


def _arm_kill_mid_average(comm, die_file: Path, emit) -> None:
    """The `kill-mid-average` actions: once `die_file` exists (the driver's request), this member
    dies in its next average (DiLoCo's `allreduce_with_retry`, or a float "avg" or "sum" allreduce). Half the
    time as it arrives there, before contributing (the others, in step, are in the average or
    about to be); else a timer (SIGALRM, whose default action ends the process in the kernel, as
    -9 does, wherever its threads are) fires after a random part of the averages' measured
    duration, inside the allreduce. If the average returns first, the member kills itself (-9)
    then and logs that it missed. The hooks are instance attributes: DiLoCo holds the
    communicator itself."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # here, on the main thread (an async average runs on another)
    rng = random.Random(os.getpid())
    state = {"armed": False, "took": 0.001}  # took: the averages' duration, smoothed

    def hooked(call):
        def average(x, op="sum", **kw):
            arm = not state["armed"] and die_file.exists()
            if arm:
                state["armed"] = True
                if comm.world_size < 3:
                    # The view shrank since the driver asked (a member evicted meanwhile): the
                    # others would no longer be a majority without this one.
                    emit(event="self_kill_skipped", world=comm.world_size)
                    arm = False
            if arm:
                if rng.random() < 0.5:
                    emit(event="self_kill", how="arrival", during_average=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                delay = rng.uniform(0, state["took"])
                emit(event="self_kill_armed", how="timer", delay_ms=delay * 1000, average_ms=state["took"] * 1000)
                signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
            start = time.perf_counter()
            try:
                return call(x, op, **kw)
            finally:
                took = time.perf_counter() - start
                state["took"] = 0.8 * state["took"] + 0.2 * took
                if arm:  # still alive: the average was quicker than the timer
                    emit(event="self_kill", how="timer", during_average=False, average_ms=took * 1000)
                    os.kill(os.getpid(), signal.SIGKILL)
        return average

    real_retry, real_allreduce = comm.allreduce_with_retry, comm.allreduce
    comm.allreduce_with_retry = hooked(real_retry)
    hook_avg = hooked(real_allreduce)
    # DiLoCo's average in elastic mode is two float sums (the weights, then the deltas): either
    # is "inside an average". The update point's allreduce is an integer one.
    comm.allreduce = lambda x, op="sum", **kw: (hook_avg(x, op, **kw) if op in ("avg", "sum") and x.dtype.kind == "f"
                                               else real_allreduce(x, op, **kw))


class _Zygote:
    """The driver's end of `diloco_zygote_main`: forks members, learns how they end."""

    def __init__(self, workdir: Path, timeout: float = 120.0):
        import queue
        import threading

        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.err = workdir / "zygote.err"
        self.proc = subprocess.Popen([sys.executable, "-m", "plait.tools.testbed.churn", "diloco-zygote"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.err, "w"), text=True)
        self.exits: Dict[int, int] = {}
        self.answers = queue.Queue()
        threading.Thread(target=self._read, name="churn-zygote", daemon=True).start()
        if self._answer(timeout) != "ready":
            raise RuntimeError(f"the members' parent did not warm up (torch, plait) in {timeout:.0f} s: "
                               f"{self.err.read_text()[-2000:]}")

    def _read(self):
        for line in self.proc.stdout:
            word, *rest = line.split()
            if word == "exit":
                self.exits[int(rest[0])] = int(rest[1])
            else:
                if word == "forked":
                    self.exits.pop(int(rest[0]), None)  # a pid used again: its exit was reported before
                self.answers.put(line.strip())
        self.answers.put("gone")

    def _answer(self, timeout: float) -> str:
        import queue

        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            return "timeout"

    def fork(self, **request) -> "_Forked":
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(30)
        if not answer.startswith("forked "):
            raise RuntimeError(f"the members' parent did not fork ({answer}): {self.err.read_text()[-2000:]}")
        return _Forked(int(answer.split()[1]), self)

    def close(self):
        self.proc.kill()
        self.proc.wait()


class _Forked:
    """A member forked by the zygote, with the part of `subprocess.Popen` the driver uses."""

    def __init__(self, pid: int, zygote: _Zygote):
        self.pid = pid
        self.zygote = zygote

    def poll(self) -> Optional[int]:
        return self.zygote.exits.get(self.pid)

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if end is not None and time.time() >= end:
                raise subprocess.TimeoutExpired(f"member {self.pid}", timeout)
            if self.zygote.proc.poll() is not None:
                raise RuntimeError(f"the members' parent ended: {self.zygote.err.read_text()[-2000:]}")
            time.sleep(0.005)
        return self.poll()

    def send_signal(self, sig: int):
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)


@dataclass
class Member:
    proc: subprocess.Popen  # or _Forked (diloco)
    log: Path
    slot: Optional[int] = None  # its network namespace, with --netns
    contact: Optional[str] = None
    id: Optional[str] = None
    stopped_until: Optional[float] = None
    doomed: Optional[float] = None  # diloco: when it was asked to kill itself in its next average


@dataclass
class ChurnReport:
    seconds: float
    members: int
    committed: int = 0
    failed: int = 0
    wrong: int = 0
    errors: List[str] = field(default_factory=list)
    kills: int = 0
    stops: int = 0
    partitions: int = 0
    joins: int = 0
    recovery_ms: Dict[str, List[float]] = field(default_factory=dict)
    #: From a joiner's first call of join() to its admission (the members call update() before
    #: every operation, so this is the admission's own cost).
    join_ms: List[float] = field(default_factory=list)
    longest_stall_ms: float = 0.0
    epochs: int = 0
    workload: str = "allreduce"
    # diloco: the survivors' final figures and hashes (one distinct hash when all is well)
    rounds: int = 0
    inner_steps: int = 0
    end_step: Optional[int] = None
    survivors: int = 0
    distinct_hashes: int = 0
    hashes: Dict[str, int] = field(default_factory=dict)  # final hash -> survivors holding it
    final_worlds: List[int] = field(default_factory=list)
    mid_average_kills: int = 0  # kill-mid-average deaths inside the average (at arrival, or the timer inside it)
    evicted: int = 0
    probe_loss: Optional[float] = None
    first_loss: Optional[float] = None  # the first round's training loss (against probe_loss at the end)

    _DILOCO_ONLY = ("rounds", "inner_steps", "end_step", "survivors", "distinct_hashes", "hashes", "final_worlds",
                    "mid_average_kills", "evicted", "probe_loss", "first_loss")

    def percentile(self, kind: str, p: float) -> Optional[float]:
        xs = sorted(self.recovery_ms.get(kind, []))
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    def as_dict(self):
        d = dict(self.__dict__)
        if self.workload != "diloco":
            for k in self._DILOCO_ONLY:
                d.pop(k)
        for kind in list(self.recovery_ms):
            d[f"{kind}_p50_ms"] = self.percentile(kind, 50)
            d[f"{kind}_p99_ms"] = self.percentile(kind, 99)
        joins = sorted(self.join_ms)
        if joins:
            d["join_p50_ms"] = joins[len(joins) // 2]
            d["join_p99_ms"] = joins[min(len(joins) - 1, int(round(0.99 * (len(joins) - 1))))]
        return d


@dataclass
class DilocoSettings:
    """The diloco workload's settings (`plait testbed churn --workload diloco`)."""
    every: int = 5  # H, inner steps per round
    mode: str = "sync"  # sync, async, streaming
    wire: str = "int8"
    fragments: int = 1  # streaming mode
    pace: float = 0.01  # seconds slept after each inner step
    steps: int = 0  # inner steps to train (0: the driver ends it a few rounds after the chaos)
    margin_rounds: int = 10  # how far ahead of the group the end step is set


class Churn:
    def __init__(self, members: int, hb: float, workdir: Path, testbed=None, diloco: Optional[DilocoSettings] = None):
        self.n = members
        self.diloco = diloco
        self.end_file = workdir / "end"
        self.die_dir = workdir / "die"
        self.end_step: Optional[int] = None
        self.zygote: Optional[_Zygote] = None  # diloco: the members' parent
        self.hb = hb
        self.dir = workdir
        self.testbed = testbed
        self.free_slots = list(range(members)) if testbed else []
        self.cut: Optional[tuple] = None  # (side A slots, side B slots, heal time)
        self.stop_file = workdir / "stop"
        self.members: List[Member] = []
        self.gone: List[Member] = []
        self.actions: List[tuple] = []  # (time, kind, member id)
        self.count = 0

    def _act(self, t: float, kind: str, who: Optional[str]):
        """Records an action, also in `actions.jsonl` beside the members' logs, so that a run's
        report can be read again from its directory (`report_from`)."""
        self.actions.append((t, kind, who))
        with open(self.dir / "actions.jsonl", "a") as f:
            f.write(json.dumps({"t": t, "kind": kind, "member": who}) + "\n")

    def _spawn(self, peers: List[str]) -> Member:
        m = self._process(peers)
        self.members.append(m)
        return m

    def _process(self, peers: List[str]) -> Member:
        from . import node_addr

        self.count += 1
        log = self.dir / f"member{self.count}.jsonl"
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        slot = self.free_slots.pop(0) if self.testbed else None
        listen = f"{node_addr(slot)}:0" if self.testbed else "127.0.0.1:0"
        if self.diloco:
            proc = self.zygote.fork(log=str(log), err=str(self.dir / f"member{self.count}.err"), listen=listen,
                                    peers=peers, config=str(self.dir / "diloco.json"), hb=self.hb)
            return Member(proc, log, slot)
        cmd = [sys.executable, "-m", "plait.tools.testbed.churn", "member", str(log), str(self.stop_file), str(self.hb),
               listen, *peers]
        if self.testbed:
            cmd = self.testbed.wrap(slot, cmd)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(self.dir / f"member{self.count}.err", "w"))
        return Member(proc, log, slot)

    def _wait_joined(self, m: Member, timeout: float) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            for e in _events(m.log):
                if e["event"] == "joined":
                    m.contact, m.id = e["contact"], e["id"]
                    return True
                if e["event"] == "join_failed":
                    return False
            if m.proc.poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def contacts(self) -> List[str]:
        cut_off = set(self.cut[1]) if self.cut else set()
        return [m.contact for m in self.members
                if m.contact and m.stopped_until is None and m.proc.poll() is None and m.slot not in cut_off]

    def _release(self, m: Member):
        self.members.remove(m)
        self.gone.append(m)
        if m.slot is not None:
            self.free_slots.append(m.slot)

    def reap(self):
        """Members that ended (left out by a partition, say) make room for joiners."""
        for m in list(self.members):
            if m.proc.poll() is not None and m.stopped_until is None:
                self._release(m)

    def partition(self, rng, seconds: float):
        """Cuts every cable between a random half of the namespaces and the rest, and the LAN
        ports of that half, for `seconds`."""
        from . import _run

        slots = list(range(self.n))
        rng.shuffle(slots)
        b, a = sorted(slots[: self.n // 2]), sorted(slots[self.n // 2:])
        self._act(time.time(), "partition", None)
        self._set_cut(a, b, up=False)
        self.cut = (a, b, time.time() + seconds)

    def heal_due(self):
        if self.cut and time.time() >= self.cut[2]:
            a, b, _ = self.cut
            self._set_cut(a, b, up=True)
            self._act(time.time(), "heal", None)
            self.cut = None

    def _set_cut(self, a, b, up):
        from . import _run

        from . import cable_addr, cable_iface, node_addr

        tb = self.testbed
        for i in a:
            for j in b:
                if j in tb.peers(i):
                    tb.set_cable(i, j, up)
                    tb.set_cable(j, i, up)
                    if up and tb.node_addrs:
                        # A cable taken down loses the host routes through it.
                        for x, y in ((i, j), (j, i)):
                            _run(["ip", "-n", tb.ns(x), "route", "replace", f"{node_addr(y)}/32", "via", cable_addr(y, x),
                                  "dev", cable_iface(x, y), "src", node_addr(x)])
        for j in b:
            _run(["ip", "-n", tb.lan_ns, "link", "set", f"port{j}", "up" if up else "down"])

    def start(self):
        self.stop_file.unlink(missing_ok=True)
        if self.diloco:
            import dataclasses

            self.end_file.unlink(missing_ok=True)
            self.die_dir.mkdir(exist_ok=True)
            (self.dir / "diloco.json").write_text(json.dumps(
                {**dataclasses.asdict(self.diloco), "end_file": str(self.end_file), "die_dir": str(self.die_dir)}))
            if self.diloco.steps:
                self._write_end(self.diloco.steps)
            self.zygote = _Zygote(self.dir)
        founder = self._spawn([])
        if not self._wait_joined(founder, 60 if self.diloco else 30):
            raise RuntimeError(f"the founder did not start: {founder.log.with_suffix('.err').read_text()[-2000:]}")
        for _ in range(self.n - 1):
            self.join()

    def join(self, wait: bool = True) -> Member:
        m = self._spawn(self.contacts())
        self._act(time.time(), "join", None)
        if wait:
            self._wait_joined(m, 60 if self.diloco else 30)
        return m

    def live(self) -> List[Member]:
        """Members running, joined and not stopped, most senior first (the order they joined)."""
        for m in self.members:
            if m.id is None:
                for e in _events(m.log):
                    if e["event"] == "joined":
                        m.contact, m.id = e["contact"], e["id"]
        return [m for m in self.members if m.proc.poll() is None and m.stopped_until is None and m.id and m.doomed is None]

    def running(self) -> int:
        """Members that count towards the group's size: running, joining or stopped."""
        return sum(1 for m in self.members if m.proc.poll() is None)

    def kill(self, m: Member, label: str = "kill"):
        self._act(time.time(), label, m.id)
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait()
        self._release(m)

    def stop(self, m: Member, seconds: float):
        self._act(time.time(), "stop", m.id)
        m.proc.send_signal(signal.SIGSTOP)
        m.stopped_until = time.time() + seconds

    def kill_mid_average(self, m: Member, label: str = "kill-mid-average"):
        """diloco: asks `m` to kill itself (-9) inside its next outer average; it dies within a
        round (`doomed_due` kills it plainly if not)."""
        self._act(time.time(), label, m.id)
        (self.die_dir / m.id).touch()
        m.doomed = time.time()

    def doomed_due(self, timeout: float = 10.0):
        """Releases the members that killed themselves; one that did not within `timeout` is
        killed plainly (its log says no `self_kill`)."""
        for m in list(self.members):
            if m.doomed is None:
                continue
            if m.proc.poll() is not None:
                self._release(m)
            elif any(e["event"] == "self_kill_skipped" for e in _events(m.log)):
                m.doomed = None  # it stays: too few members were left
            elif time.time() - m.doomed > timeout:
                m.proc.send_signal(signal.SIGKILL)
                m.proc.wait()
                self._release(m)

    def group_size(self) -> int:
        """diloco: the size of the latest view any member logged (0 if none yet)."""
        return max(((e["epoch"], e["world"]) for m in self.members for e in _events(m.log) if "world" in e), default=(-1, 0))[1]

    def progress(self) -> int:
        """diloco: the most inner steps any member has logged a round at."""
        return max((e.get("steps", 0) for m in self.members for e in _events(m.log) if e["event"] == "round"), default=0)

    def _write_end(self, step: int):
        self.end_step = step
        self._act(time.time(), "end_step", str(step))
        tmp = self.end_file.with_suffix(".tmp")
        tmp.write_text(str(step))
        tmp.replace(self.end_file)  # whole, or not there

    def settle(self, refill: float = 10.0, timeout: float = 30.0):
        """diloco, after the chaos: stopped members resume (and leave), members asked to die do,
        and joiners refill the group (for up to `refill` seconds) and are admitted, so that the
        group's membership is still when the end step is set."""
        end = time.time() + timeout
        full = time.time() + refill
        while time.time() < end:
            self.resume_due()
            self.doomed_due()
            self.reap()
            self.live()
            if time.time() < full and self.contacts():
                while self.running() < self.n:
                    self.join(wait=False)
            if (all(m.stopped_until is None and m.doomed is None and m.id for m in self.members)
                    and (self.running() >= self.n or time.time() >= full)):
                break
            time.sleep(0.05)

    def end(self, timeout: float = 60.0):
        """diloco: sets the end step (a few rounds ahead of the group, on a round boundary, unless
        the run has a fixed count) and waits for the members to finish and leave."""
        if self.end_step is None:
            h = self.diloco.every
            self._write_end((self.progress() // h + self.diloco.margin_rounds) * h)
        for m in self.live():
            self._act(time.time(), "end", m.id)
        deadline = time.time() + timeout
        for m in self.members:
            try:
                m.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass

    def resume_due(self):
        now = time.time()
        for m in list(self.members):
            if m.stopped_until is not None and now >= m.stopped_until:
                m.proc.send_signal(signal.SIGCONT)
                m.stopped_until = None
                # It was left out: it learns so and exits; a new member takes its place.
                self._release(m)

    def finish(self, grace: float = 20.0):
        if self.cut:
            self._set_cut(self.cut[0], self.cut[1], up=True)
            self.cut = None
        self.stop_file.touch()
        for m in self.members:
            if m.stopped_until is not None:
                m.proc.send_signal(signal.SIGCONT)
        # diloco members do not watch the stop file: those still running (the run was cut short,
        # or they hung past `end()`) are killed at once.
        end = time.time() + (0 if self.diloco else grace)
        try:
            for m in self.members + self.gone:
                try:
                    m.proc.wait(max(0.1, end - time.time()))
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(10)
        finally:
            if self.zygote:
                self.zygote.close()

    def report(self, seconds: float) -> ChurnReport:
        if self.diloco:
            return _report_diloco(self.actions, [m.log for m in self.members + self.gone], seconds, self.n)
        return _report(self.actions, [m.log for m in self.members + self.gone], seconds, self.n)


def report_from(workdir: Path, seconds: float, members: int) -> ChurnReport:
    """The report of a run, read again from its directory (its `actions.jsonl` and the members'
    logs)."""
    actions = [(a["t"], a["kind"], a["member"]) for a in _events(Path(workdir) / "actions.jsonl")]
    report = _report_diloco if (Path(workdir) / "diloco.json").exists() else _report
    return report(actions, sorted(Path(workdir).glob("member*.jsonl")), seconds, members)


def _report(actions, logs, seconds: float, members: int) -> ChurnReport:
    r = ChurnReport(seconds=seconds, members=members)
    done = {}  # (epoch, index) -> completion time (earliest member)
    for log in logs:
        events = _events(log)
        asked = [e["t"] for e in events if e["event"] == "joining"]
        joined = [e["t"] for e in events if e["event"] == "joined" and e.get("epoch", 0) > 0]
        if asked and joined:
            r.join_ms.append((joined[0] - asked[0]) * 1000)
        for e in events:
            kind = e["event"]
            if kind == "ok":
                key = (e["epoch"], e["index"])
                done[key] = min(done.get(key, e["t"]), e["t"])
            elif kind == "lost":
                r.failed += 1
            elif kind == "wrong":
                r.wrong += 1
            elif kind in ("error", "join_failed"):
                r.errors.append(e["error"])
    r.committed = len(done)
    commits = sorted((t, epoch) for (epoch, _), t in done.items())
    times = [t for t, _ in commits]
    r.epochs = len({epoch for _, epoch in commits})
    if len(times) > 1:
        r.longest_stall_ms = max(b - a for a, b in zip(times, times[1:])) * 1000
    # The latest epoch committed by each point in time, to find the first commit of a later one.
    latest = list(itertools.accumulate((epoch for _, epoch in commits), max))
    for t, kind, _ in actions:
        if kind == "join":
            r.joins += 1
            continue
        r.kills += kind in ("kill", "kill-leader")
        r.stops += kind == "stop"
        r.partitions += kind == "partition"
        i = bisect.bisect_right(times, t)
        if i == len(times):
            continue
        # The next operation committed in a later epoch than the last one before the action
        # (else, if none, the next one at all).
        last_epoch = latest[i - 1] if i else -1
        j = next((k for k in range(i, len(commits)) if commits[k][1] > last_epoch), i)
        r.recovery_ms.setdefault(kind, []).append((times[j] - t) * 1000)
    return r


def _report_diloco(actions, logs, seconds: float, members: int) -> ChurnReport:
    r = ChurnReport(seconds=seconds, members=members, workload="diloco")
    done_at: Dict[int, float] = {}  # round -> when a member first completed it
    finals: Dict[str, dict] = {}  # member id -> its "done" event
    deaths: Dict[str, float] = {}  # member id -> when it killed itself
    spared = set()  # members asked to die in an average whose view had shrunk below 3 by then
    first = None
    for log in logs:
        events = _events(log)
        asked = [e["t"] for e in events if e["event"] == "joining"]
        joined = [e for e in events if e["event"] == "joined"]
        if asked and joined and joined[0].get("epoch", 0) > 0:
            r.join_ms.append((joined[0]["t"] - asked[0]) * 1000)
        me = joined[0]["id"] if joined else None
        for e in events:
            kind = e["event"]
            if kind == "round":
                done_at[e["rounds"]] = min(done_at.get(e["rounds"], e["t"]), e["t"])
                r.epochs = max(r.epochs, e["epoch"])
                if first is None or e["rounds"] < first[0]:
                    first = (e["rounds"], e["loss"])
            elif kind == "done":
                finals[me] = e
            elif kind in ("self_kill", "self_kill_armed"):
                deaths[me] = e["t"]
            elif kind == "self_kill_skipped":
                spared.add(me)
            elif kind == "evicted":
                r.evicted += 1
            elif kind in ("error", "join_failed"):
                r.errors.append(e["error"])
        # A timer armed and no "self_kill" after it: the timer ended the process inside the average.
        kills = [e for e in events if e["event"] in ("self_kill", "self_kill_armed")]
        if kills and (kills[-1]["event"] == "self_kill_armed" or kills[-1]["during_average"]):
            r.mid_average_kills += 1
    r.first_loss = first[1] if first else None
    for _, kind, who in actions:
        if kind == "end" and who not in finals:
            r.errors.append(f"member {who} was running at the end but logged no final state (hung, or died: its log)")
    r.survivors = len(finals)
    for e in finals.values():
        r.hashes[e["hash"]] = r.hashes.get(e["hash"], 0) + 1
    r.distinct_hashes = len(r.hashes)
    if finals:
        r.rounds = max(e["rounds"] for e in finals.values())
        r.inner_steps = max(e["steps"] for e in finals.values())
        r.final_worlds = sorted(e["world"] for e in finals.values())
        r.probe_loss = min(e["probe_loss"] for e in finals.values())
    ends = [int(a[2]) for a in actions if a[1] == "end_step"]
    r.end_step = ends[-1] if ends else None
    times = sorted(done_at.values())
    if len(times) > 1:
        r.longest_stall_ms = max(b - a for a, b in zip(times, times[1:])) * 1000
    for t, kind, who in actions:
        if kind == "join":
            r.joins += 1
            continue
        if kind not in ("kill", "kill-leader", "stop", "kill-mid-average", "kill-leader-mid-average") or who in spared:
            continue
        r.kills += kind != "stop"
        r.stops += kind == "stop"
        t = deaths.get(who, t) if "mid-average" in kind else t  # when it died, not when it was asked
        i = bisect.bisect_right(times, t)
        if i < len(times):
            r.recovery_ms.setdefault(kind, []).append((times[i] - t) * 1000)
    return r


def _events(path: Path):
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill
    return out


def run_churn(members: int = 4, seconds: float = 30.0, every: float = 1.5, hb: float = 0.5,
              kinds=("kill", "stop", "kill-leader"), seed: int = 0, workdir: Optional[Path] = None,
              progress=None, netns: bool = False, partition_seconds: float = 3.0,
              diloco: Optional[DilocoSettings] = None) -> ChurnReport:
    """Runs the chaos for `seconds`: every `every` seconds one action among `kinds` on a random
    live member (the most senior one for "kill-leader"; "partition" cuts the network between two
    halves for `partition_seconds`, with `netns`); a member killed, stopped or left out is
    replaced by a joiner, so the group keeps `members` members. With `diloco` (settings), the
    members train with DiLoCo instead of running allreduces (the module's docstring), and
    "kill-mid-average" / "kill-leader-mid-average" are actions too; the chaos then ends early if
    the group nears `diloco.steps`."""
    if diloco is not None:
        if netns or "partition" in kinds:
            raise ValueError("the diloco workload does not support --netns or partitions")
        return _run_churn(members, seconds, every, hb, kinds, seed, workdir, progress, None, partition_seconds, diloco)
    if any("mid-average" in k for k in kinds):
        raise ValueError("the kill-mid-average actions need the diloco workload")
    if netns:
        from . import Testbed

        with Testbed(members, link_rate="none", lan_rate="none", name="plaitchurn", node_addrs=True) as tb:
            return _run_churn(members, seconds, every, hb, kinds, seed, workdir, progress, tb, partition_seconds)
    if "partition" in kinds:
        raise ValueError("a partition needs --netns (each member in its own network namespace)")
    return _run_churn(members, seconds, every, hb, kinds, seed, workdir, progress, None, partition_seconds)


def _run_churn(members, seconds, every, hb, kinds, seed, workdir, progress, testbed, partition_seconds, diloco=None):
    rng = random.Random(seed)
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="plait-churn-")) if own_dir else workdir
    churn = Churn(members, hb, workdir, testbed, diloco)
    try:
        churn.start()
        start = time.time()
        next_action = start + every
        next_look = start
        while time.time() - start < seconds:
            churn.resume_due()
            churn.heal_due()
            churn.doomed_due()
            churn.reap()
            now = time.time()
            if diloco and diloco.steps and now >= next_look:
                # A fixed count: the chaos stops a few rounds before the group reaches it.
                next_look = now + 0.5
                if churn.progress() >= diloco.steps - 2 * diloco.margin_rounds * diloco.every:
                    break
            if now >= next_action and churn.cut is None:
                live = churn.live()
                # A majority must survive every single loss (and one at a time: none still to die).
                # diloco: and the group's own view, as the members logged it (a member evicted
                # for silence, starved of the CPU, may not have exited yet).
                if (len(live) >= 3 and not any(m.doomed for m in churn.members)
                        and (not diloco or churn.group_size() >= 3)):
                    kind = rng.choice(kinds)
                    if kind == "kill-leader":
                        churn.kill(live[0], "kill-leader")
                    elif kind == "kill":
                        churn.kill(rng.choice(live))
                    elif kind == "kill-leader-mid-average":
                        churn.kill_mid_average(live[0], kind)
                    elif kind == "kill-mid-average":
                        churn.kill_mid_average(rng.choice(live), kind)
                    elif kind == "partition":
                        churn.partition(rng, partition_seconds)
                    else:
                        churn.stop(rng.choice(live), 2 * hb + 0.5)
                    if progress:
                        progress(f"{now - start:6.1f}s {kind}")
                next_action = now + every
            # diloco: with no member left to join (the group lost its majority and gave up), a
            # joiner would found a new group: a new run, whose end would say nothing of this one.
            if churn.cut is None and not (diloco and not churn.contacts()):
                while churn.running() < members:
                    churn.join(wait=False)
            time.sleep(0.01)
        if diloco:
            if progress:
                progress(f"{time.time() - start:6.1f}s chaos over: stopped members resume, joiners come in")
            churn.settle()
            churn.end()
            if progress:
                progress(f"{time.time() - start:6.1f}s the group ended at inner step {churn.end_step}")
    finally:
        churn.finish()
    return churn.report(seconds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["member"]:
        sys.exit(member_main(sys.argv[2:]))
    if sys.argv[1:2] == ["diloco-zygote"]:
        sys.exit(diloco_zygote_main(sys.argv[2:]))
    sys.exit("usage: python -m plait.tools.testbed.churn member LOG STOPFILE HB LISTEN [PEER...]\n"
             "       python -m plait.tools.testbed.churn diloco-zygote  (requests on stdin)")
