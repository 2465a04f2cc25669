"""Launches a world of local processes running one scenario of torch_scenarios.py.

Each rank is a separate `python torch_scenarios.py NAME OUTDIR` process with torchrun's
environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK). A scenario returns a picklable
result; `run_world` returns the list of results by rank, or raises with every rank's output when
a rank fails or the world does not finish in time (all ranks are then killed).
"""

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "torch_scenarios.py"
REPO = HERE.parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorldFailed(AssertionError):
    pass


def run_world(scenario, nproc, *, timeout=180, env=None, args=(), expect_exit=None, script=SCENARIOS):
    """Runs `scenario` of `script` (default torch_scenarios.py) on `nproc` ranks; returns [result
    of rank 0, ...] (None for a rank that wrote no result). `expect_exit`: {rank: returncode}
    for ranks expected to die."""
    expect_exit = dict(expect_exit or {})
    port = free_port()
    out = Path(tempfile.mkdtemp(prefix=f"plait-{scenario}-"))
    procs, logs = [], []
    base = dict(os.environ)
    base.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })
    base.update(env or {})
    for r in range(nproc):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r), GROUP_RANK="0")
        log = open(out / f"rank{r}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(script), scenario, str(out), *map(str, args)],
            env=e, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
        ))
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            timed_out = True
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()

    def dump():
        parts = []
        for r, log in enumerate(logs):
            log.seek(0)
            text = log.read()
            parts.append(f"--- rank {r} (exit {procs[r].returncode}) ---\n{text[-6000:]}")
        return "\n".join(parts)

    bad = [r for r, p in enumerate(procs) if p.returncode != expect_exit.get(r, 0)]
    if timed_out or bad:
        why = f"timed out after {timeout} s" if timed_out else f"ranks {bad} exited badly"
        raise WorldFailed(f"scenario {scenario} on {nproc} ranks: {why}\n{dump()}")
    results = []
    for r in range(nproc):
        f = out / f"result{r}.pkl"
        results.append(pickle.loads(f.read_bytes()) if f.exists() else None)
    for log in logs:
        log.close()
    return results
