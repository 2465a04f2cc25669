"""p50 latency of a blocking 4-byte `dist.all_reduce`: plait next to gloo, measured in one run.

    python tests/torch/bench_small.py                 # worlds 2 and 3, 4000 calls per backend
    python tests/torch/bench_small.py --worlds 2,3,4 --iters 10000 --json out.json

Every rank builds a gloo world group and plait groups over the same ranks and times the three in
interleaved rounds, so machine noise hits them alike. Per backend the figure reported is the
slowest rank's p50 (the nccl-tests convention).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_launch import run_world  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = []
    for world in [int(w) for w in a.worlds.split(",")]:
        results = run_world("bench_small", world, timeout=600, args=[a.iters])
        names = [k for k in results[0] if isinstance(results[0][k], dict)]
        row = {"world": world, "algorithm": results[0]["algorithm"]}
        for name in names:
            row[name] = max(r[name]["p50_us"] for r in results)
            row[name + " p90"] = max(r[name]["p90_us"] for r in results)
        rows.append(row)
    print(f"4-byte blocking all_reduce, p50 of the slowest rank (us), {a.iters} calls per backend")
    print(f"{'world':>5}  {'gloo':>8}  {'plait':>8}  {'plait/gloo':>10}  {'plait, no inline':>16}  algorithm")
    for r in rows:
        print(f"{r['world']:>5}  {r['gloo']:>8.1f}  {r['plait']:>8.1f}  {r['plait'] / r['gloo']:>10.2f}  "
              f"{r['plait (no inline)']:>16.1f}  {r['algorithm']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
