"""`plait testbed churn`: elastic members on this machine run allreduces on deterministic inputs
while a chaos driver kills (-9), stops (SIGSTOP, then SIGCONT) or starts members, and, with
`--netns` (each member in its own network namespace of a testbed), cuts the network between two
halves of the group for a while (a partition).

Every member checks every result it returns against the sum of the inputs of the members of the
view it ran in (an input is a function of the member, the epoch and the operation's index in it),
and logs one JSON line per event. The driver reads the logs and reports: operations committed,
failed (PeerLost) and wrong (must be 0), the time from each kill or stop to the next committed
operation (p50, p99), and the longest stall.
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

    emit(event="joining")
    try:
        comm = plait.elastic.join(peers, listen=listen, heartbeat_timeout=hb, timeout=max(30.0, 10 * hb))
    except plait.PlaitError as e:
        emit(event="join_failed", error=str(e))
        return 1
    emit(event="joined", id=comm.member_id, contact=comm.contact, epoch=comm.epoch, pid=os.getpid())
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


@dataclass
class Member:
    proc: subprocess.Popen
    log: Path
    slot: Optional[int] = None  # its network namespace, with --netns
    contact: Optional[str] = None
    id: Optional[str] = None
    stopped_until: Optional[float] = None


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

    def percentile(self, kind: str, p: float) -> Optional[float]:
        xs = sorted(self.recovery_ms.get(kind, []))
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    def as_dict(self):
        d = dict(self.__dict__)
        for kind in list(self.recovery_ms):
            d[f"{kind}_p50_ms"] = self.percentile(kind, 50)
            d[f"{kind}_p99_ms"] = self.percentile(kind, 99)
        joins = sorted(self.join_ms)
        if joins:
            d["join_p50_ms"] = joins[len(joins) // 2]
            d["join_p99_ms"] = joins[min(len(joins) - 1, int(round(0.99 * (len(joins) - 1))))]
        return d


class Churn:
    def __init__(self, members: int, hb: float, workdir: Path, testbed=None):
        self.n = members
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
        from . import node_addr

        self.count += 1
        log = self.dir / f"member{self.count}.jsonl"
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        slot = self.free_slots.pop(0) if self.testbed else None
        listen = f"{node_addr(slot)}:0" if self.testbed else "127.0.0.1:0"
        cmd = [sys.executable, "-m", "plait.tools.testbed.churn", "member", str(log), str(self.stop_file), str(self.hb),
               listen, *peers]
        if self.testbed:
            cmd = self.testbed.wrap(slot, cmd)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(self.dir / f"member{self.count}.err", "w"))
        m = Member(proc, log, slot)
        self.members.append(m)
        return m

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
        founder = self._spawn([])
        if not self._wait_joined(founder, 30):
            raise RuntimeError(f"the founder did not start: {(self.dir / 'member1.err').read_text()[-2000:]}")
        for _ in range(self.n - 1):
            self.join()

    def join(self, wait: bool = True) -> Member:
        m = self._spawn(self.contacts())
        self._act(time.time(), "join", None)
        if wait:
            self._wait_joined(m, 30)
        return m

    def live(self) -> List[Member]:
        """Members running, joined and not stopped, most senior first (the order they joined)."""
        for m in self.members:
            if m.id is None:
                for e in _events(m.log):
                    if e["event"] == "joined":
                        m.contact, m.id = e["contact"], e["id"]
        return [m for m in self.members if m.proc.poll() is None and m.stopped_until is None and m.id]

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
        end = time.time() + grace
        for m in self.members + self.gone:
            try:
                m.proc.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait()

    def report(self, seconds: float) -> ChurnReport:
        return _report(self.actions, [m.log for m in self.members + self.gone], seconds, self.n)


def report_from(workdir: Path, seconds: float, members: int) -> ChurnReport:
    """The report of a run, read again from its directory (its `actions.jsonl` and the members'
    logs)."""
    actions = [(a["t"], a["kind"], a["member"]) for a in _events(Path(workdir) / "actions.jsonl")]
    return _report(actions, sorted(Path(workdir).glob("member*.jsonl")), seconds, members)


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
              progress=None, netns: bool = False, partition_seconds: float = 3.0) -> ChurnReport:
    """Runs the chaos for `seconds`: every `every` seconds one action among `kinds` on a random
    live member (the most senior one for "kill-leader"; "partition" cuts the network between two
    halves for `partition_seconds`, with `netns`); a member killed, stopped or left out is
    replaced by a joiner, so the group keeps `members` members."""
    if netns:
        from . import Testbed

        with Testbed(members, link_rate="none", lan_rate="none", name="plaitchurn", node_addrs=True) as tb:
            return _run_churn(members, seconds, every, hb, kinds, seed, workdir, progress, tb, partition_seconds)
    if "partition" in kinds:
        raise ValueError("a partition needs --netns (each member in its own network namespace)")
    return _run_churn(members, seconds, every, hb, kinds, seed, workdir, progress, None, partition_seconds)


def _run_churn(members, seconds, every, hb, kinds, seed, workdir, progress, testbed, partition_seconds):
    rng = random.Random(seed)
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="plait-churn-")) if own_dir else workdir
    churn = Churn(members, hb, workdir, testbed)
    churn.start()
    start = time.time()
    next_action = start + every
    try:
        while time.time() - start < seconds:
            churn.resume_due()
            churn.heal_due()
            churn.reap()
            now = time.time()
            if now >= next_action and churn.cut is None:
                live = churn.live()
                if len(live) >= 3:  # a majority must survive every single loss
                    kind = rng.choice(kinds)
                    if kind == "kill-leader":
                        churn.kill(live[0], "kill-leader")
                    elif kind == "kill":
                        churn.kill(rng.choice(live))
                    elif kind == "partition":
                        churn.partition(rng, partition_seconds)
                    else:
                        churn.stop(rng.choice(live), 2 * hb + 0.5)
                    if progress:
                        progress(f"{now - start:6.1f}s {kind}")
                next_action = now + every
            if churn.cut is None:
                while churn.running() < members:
                    churn.join(wait=False)
            time.sleep(0.01)
    finally:
        churn.finish()
    return churn.report(seconds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["member"]:
        sys.exit(member_main(sys.argv[2:]))
    sys.exit("usage: python -m plait.tools.testbed.churn member LOG STOPFILE HB LISTEN [PEER...]")
