"""Point-to-point latency through the "plait" backend on 2 ranks (ordering is checked on the way).

    python tests/torch/bench_p2p.py                  # 1000 round trips per size and style
    python tests/torch/bench_p2p.py --iters 3000 --json out.json

Round trips between ranks 0 and 1 with blocking send/recv and with isend/irecv (4 B, 64 KiB,
1 MiB), and the cost per message of a stream of 4-byte isends on one tag; on a default group and on
one that never runs inline. Figures are rank 0's p50 and p90 (the stream: median and worst of 5).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_launch import run_world  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    results = run_world("p2p", 2, timeout=900, args=[a.iters])
    failures = [f for r in results for f in r["failures"]]
    for f in failures:
        print("FAILED", f)
    timings = results[0]["timings"]
    print(f"point-to-point between 2 ranks, rank 0's figures (us), {a.iters} round trips each")
    for group, rows in timings.items():
        print(f"\n{group} group{'':<46}  {'p50':>9}  {'p90':>9}")
        for what, (p50, p90) in rows.items():
            print(f"  {what:<56}  {p50:>9.1f}  {p90:>9.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"timings": timings, "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
