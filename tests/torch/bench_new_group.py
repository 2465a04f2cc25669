"""What a `dist.new_group` costs: plait next to gloo, measured in one run.

    python tests/torch/bench_new_group.py                  # 4 ranks, 3 rounds per backend
    python tests/torch/bench_new_group.py --world 8 --rounds 5 --json out.json

Each round starts a fresh world per backend (alternating gloo and plait, so machine noise hits
both alike), then times, on every rank: `new_group` over all ranks, `new_group` over each
neighbouring pair (every rank takes part in every call, as torch requires), and the first
`all_reduce` on the new group (a backend that builds lazily pays there). The figure is the
slowest rank's median per call, in milliseconds.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp


def _rank_main(rank, world, backend, port, calls, out):
    import torch
    import torch.distributed as dist

    if backend == "plait":
        import plait.torch  # noqa: F401  registers the backend on torch versions without entry points
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    t = torch.ones(4)
    dist.all_reduce(t)
    timings = {"new_group (all ranks)": [], "new_group (a pair)": [], "first all_reduce": []}
    for _ in range(calls):
        t0 = time.perf_counter()
        g = dist.new_group(list(range(world)))
        timings["new_group (all ranks)"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=g)
        timings["first all_reduce"].append(time.perf_counter() - t0)
        for first in range(0, world - 1, 2):
            t0 = time.perf_counter()
            dist.new_group([first, first + 1])
            timings["new_group (a pair)"].append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, {k: statistics.median(v) * 1e3 for k, v in timings.items()}))


def run(backend, world, calls, port):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, backend, port, calls, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"{backend}: rank process exited with {p.exitcode}")
    return {k: max(r[k] for _, r in results) for k in results[0][1]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10, help="new_group calls of each kind per round")
    ap.add_argument("--backends", default="gloo,plait")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    backends = a.backends.split(",")
    rounds = {b: [] for b in backends}
    port = 29000 + os.getpid() % 2000
    for i in range(a.rounds):
        for b in backends:
            port += 1
            rounds[b].append(run(b, a.world, a.calls, port))
    kinds = list(rounds[backends[0]][0])
    print(f"{a.world} ranks, slowest rank's median per call (ms), median of {a.rounds} rounds")
    print(f"{'':<24}" + "".join(f"{b:>10}" for b in backends) + ("   plait/gloo" if set(backends) >= {"plait", "gloo"} else ""))
    summary = {}
    for k in kinds:
        med = {b: statistics.median(r[k] for r in rounds[b]) for b in backends}
        summary[k] = med
        ratio = f"   {med['plait'] / med['gloo']:>10.2f}" if set(backends) >= {"plait", "gloo"} else ""
        print(f"{k:<24}" + "".join(f"{med[b]:>10.2f}" for b in backends) + ratio)
    if a.json:
        Path(a.json).write_text(json.dumps({"world": a.world, "rounds": rounds, "median": summary}, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(main() and 0)
