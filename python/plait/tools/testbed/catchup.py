"""`plait testbed catchup`: how long a joiner takes to receive the group's shared state, from 1,
2, 4... holders, each holder on its own rate-limited cable to the joiner (a direct-cabled mesh of
network namespaces; root).

For each number of holders H: a testbed of H + 1 nodes; H members on nodes 0..H-1 hold the same
state (SIZE bytes) and sync it once (nothing moves); a joiner on node H, holding zeros, joins
and calls `sync_shared_state`. The figure is the joiner's sync time (its own hashing included)
and the rate it received at; striping should make it scale with H up to the joiner's CPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HOLDER, JOINER = "holder", "joiner"


def member_main(argv: List[str]) -> int:
    """One member: ROLE SIZE HOLDERS LISTEN OUT [PEER]; writes JSON events to OUT."""
    role, size, holders, listen, out = argv[0], int(argv[1]), int(argv[2]), argv[3], Path(argv[4])
    peers = argv[5:]
    import numpy as np

    import plait.elastic

    def emit(**event):
        with open(out, "a") as f:
            f.write(json.dumps(event) + "\n")

    comm = plait.elastic.join(peers, listen=listen, timeout=600)
    emit(event="joined", contact=comm.contact, id=comm.member_id)
    if role == HOLDER:
        data = np.frombuffer(np.random.default_rng(7).bytes(size), np.uint8).copy()  # the same on every holder
    else:
        data = np.zeros(size, np.uint8)
    state = plait.elastic.SharedState({"weights": data})
    if role == HOLDER:
        while comm.world_size < holders:
            comm.update()
            time.sleep(0.01)
        comm.sync_shared_state(state)  # all equal: no transfer, but they vote from now on
        emit(event="ready")
        while comm.world_size < holders + 1:
            comm.update()
            time.sleep(0.01)
    else:
        comm.update()  # True at once: the members' update point that admitted it
    report = comm.sync_shared_state(state)
    emit(event="synced", report=report)
    comm.barrier()
    comm.close()
    return 0


def _wait(path: Path, event: str, proc, timeout: float) -> Dict[str, Any]:
    end = time.time() + timeout
    while time.time() < end:
        if path.exists():
            for line in path.read_text().splitlines():
                e = json.loads(line)
                if e["event"] == event:
                    return e
        if proc.poll() is not None:
            raise RuntimeError(f"a {event!r} was awaited from a member that exited ({proc.returncode}); see {path.parent}")
        time.sleep(0.05)
    raise RuntimeError(f"no {event!r} from a member within {timeout:.0f} s; see {path.parent}")


def measure(holders: int, size: int, link_rate: str, workdir: Path, progress=None) -> Dict[str, Any]:
    import signal

    from . import Testbed, node_addr, parse_rate

    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    with Testbed(holders + 1, link_rate=link_rate, lan_rate="none", name="plaitcatch", node_addrs=True) as tb:
        try:
            def start(i, role, peers):
                out = workdir / f"h{holders}-node{i}.jsonl"
                cmd = [sys.executable, "-m", "plait.tools.testbed.catchup", "member", role, str(size), str(holders),
                       f"{node_addr(i)}:0", str(out), *peers]
                err = open(workdir / f"h{holders}-node{i}.err", "w")
                procs.append(tb.popen(i, cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=err, stderr=err))
                return out, procs[-1]

            first, p0 = start(0, HOLDER, [])
            contact = _wait(first, "joined", p0, 120)["contact"]
            logs = [(first, p0)] + [start(i, HOLDER, [contact]) for i in range(1, holders)]
            for log, p in logs:
                _wait(log, "ready", p, 300)
            if progress:
                progress(f"{holders} holder(s) ready; the joiner starts")
            t0 = time.time()
            log, p = start(holders, JOINER, [contact])
            report = _wait(log, "synced", p, 900)["report"]
            wall = time.time() - t0
            for p in procs:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
    seconds = report["seconds"]
    rate = parse_rate(link_rate)
    return {"holders": holders, "bytes": size, "link_rate_bps": rate, "sync_seconds": seconds, "join_to_synced_seconds": wall,
            "received_gbit_s": report["fetched_bytes"] * 8 / seconds / 1e9, "fetched_bytes": report["fetched_bytes"],
            "sources": len(report["sources"]), "bytes_per_source": sorted(report["sources"].values())}


def run(holder_counts: List[int], size: int, link_rate: str, workdir: Path, progress=None) -> List[Dict[str, Any]]:
    results = []
    for h in holder_counts:
        r = measure(h, size, link_rate, workdir, progress)
        if progress:
            progress(f"{h} holder(s): {r['sync_seconds']:.2f} s to sync {size / 2**30:.2f} GiB "
                     f"({r['received_gbit_s']:.2f} Gbit/s received, from {r['sources']} member(s))")
        results.append(r)
    for r in results:
        r["speedup_vs_first"] = results[0]["sync_seconds"] / r["sync_seconds"]
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "member":
        sys.exit(member_main(sys.argv[2:]))
    sys.exit("usage: plait testbed catchup (this module's `member` entry is for the members it starts)")
