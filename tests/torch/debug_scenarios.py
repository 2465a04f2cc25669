"""Scenarios of test_torch_debug.py (TORCH_DISTRIBUTED_DEBUG=DETAIL, the trace), run by every rank
of a local world like torch_scenarios.py's:

    python tests/torch/debug_scenarios.py NAME OUTDIR [ARGS...]
"""

import datetime
import os
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import plait.torch  # noqa: F401  registers "plait"

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def _attempt(fn):
    """(error type name, message) of fn(), or None when it did not raise."""
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "mro": [k.__name__ for k in type(e).__mro__], "msg": str(e)}
    return None


def scenario_detail(args):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: calls that differ between ranks raise on every rank; calls
    that agree (including uneven all_to_all and rooted calls whose lists only the root has) pass,
    with the right results; the group works after a refused call."""
    dist.init_process_group("plait", timeout=datetime.timedelta(seconds=30))
    res = {"checked": plait.torch.debug.detail_enabled()}
    odd = RANK == 1
    # same element count, different shapes
    res["shapes"] = _attempt(lambda: dist.all_reduce(torch.ones(2, 4) if odd else torch.ones(4, 2)))
    if args[1:] == ["shapes-only"]:
        dist.destroy_process_group()
        return res
    # a different collective over the same bytes
    res["op_kind"] = _attempt(lambda: dist.broadcast(torch.ones(8), 0) if RANK == WORLD - 1 else dist.all_reduce(torch.ones(8)))
    # a different root
    res["root"] = _attempt(lambda: dist.broadcast(torch.ones(3), 1 if odd else 0))
    # calls that agree, at DETAIL
    ok = []
    t = torch.full((5,), float(RANK + 1))
    dist.all_reduce(t)
    ok.append(torch.equal(t, torch.full((5,), float(sum(range(1, WORLD + 1))))))
    outs = [torch.zeros(3) for _ in range(WORLD)]
    dist.all_gather(outs, torch.full((3,), float(RANK)))
    ok.append(all(torch.equal(o, torch.full((3,), float(r))) for r, o in enumerate(outs)))
    outs = [torch.zeros(r + 1) for r in range(WORLD)]  # uneven: rank r gives r + 1 elements
    dist.all_gather(outs, torch.full((RANK + 1,), float(RANK)))
    ok.append(all(torch.equal(o, torch.full((r + 1,), float(r))) for r, o in enumerate(outs)))
    big = torch.zeros(3 * WORLD)
    dist.all_gather_into_tensor(big, torch.full((3,), float(RANK)))
    ok.append(torch.equal(big, torch.arange(WORLD).repeat_interleave(3).float()))
    # uneven all_to_all_single: each rank sends r+1 elements to rank r
    send = torch.full((sum(range(1, WORLD + 1)),), float(RANK))
    recv = torch.zeros((RANK + 1) * WORLD)
    dist.all_to_all_single(recv, send, [RANK + 1] * WORLD, [r + 1 for r in range(WORLD)])
    ok.append(torch.equal(recv, torch.arange(WORLD).repeat_interleave(RANK + 1).float()))
    g = [torch.zeros(2) for _ in range(WORLD)] if RANK == 0 else None
    dist.gather(torch.full((2,), float(RANK)), g, dst=0)
    ok.append(RANK != 0 or all(torch.equal(x, torch.full((2,), float(r))) for r, x in enumerate(g)))
    out = torch.zeros(2)
    dist.reduce_scatter(out, [torch.full((2,), float(RANK)) for _ in range(WORLD)])
    ok.append(torch.equal(out, torch.full((2,), float(sum(range(WORLD))))))
    s = torch.zeros(2)
    dist.scatter(s, [torch.full((2,), float(r)) for r in range(WORLD)] if RANK == 0 else None, src=0)
    ok.append(torch.equal(s, torch.full((2,), float(RANK))))
    sub = dist.new_group(list(range(WORLD)))
    res["sub_shapes"] = _attempt(lambda: dist.all_reduce(torch.ones(1, 6) if odd else torch.ones(6), group=sub))
    x = torch.ones(4)
    dist.all_reduce(x, group=sub)
    ok.append(torch.equal(x, torch.full((4,), float(WORLD))))
    dist.barrier()
    res["ok"] = ok
    dist.destroy_process_group()
    return res


def scenario_skip(args):
    """Rank `WORLD - 1` skips the fourth all_reduce; the others time out. Every rank writes its
    trace (the skipper because the others tell it to, through the store), and waits for it."""
    out = Path(args[0])
    trace_dir = os.environ["PLAIT_TRACE_DIR"]
    dist.init_process_group("plait", timeout=datetime.timedelta(seconds=float(args[1])))
    dist.barrier()
    x = torch.ones(1024)
    for _ in range(3):
        dist.all_reduce(x)
    res = {}
    if RANK != WORLD - 1:
        res["error"] = _attempt(lambda: dist.all_reduce(x))
    mine = Path(trace_dir) / f"plait_trace_rank_{RANK}.json"
    deadline = time.monotonic() + 30
    while not mine.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    res["dumped"] = mine.exists()
    # the file is written to a temporary name and renamed: once it exists it is whole
    (out / f"dumped{RANK}").write_text("1")
    # nobody leaves before every rank has written its trace (the skipper waits for a signal)
    deadline = time.monotonic() + 30
    while not all((out / f"dumped{r}").exists() for r in range(WORLD)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return res


def scenario_entries(args):
    """PLAIT_TRACE_ENTRIES bounds the trace; 0 turns it off."""
    from plait.torch import trace

    dist.init_process_group("plait", timeout=datetime.timedelta(seconds=30))
    for _ in range(20):
        dist.all_reduce(torch.ones(4))
    doc = trace.document("test")
    dist.destroy_process_group()
    return {"groups": [(g["name"], len(g["entries"]), [e["collective_seq_id"] for e in g["entries"]]) for g in doc["groups"]]}


def main():
    name, out = sys.argv[1], Path(sys.argv[2])
    args = [str(out)] + sys.argv[3:]
    result = globals()[f"scenario_{name}"](args)
    (out / f"result{RANK}.pkl").write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    # a world whose collective failed is torn down by exiting: the failed group cannot be
    # destroyed in step (its peers may be gone)
    os._exit(0)


if __name__ == "__main__":
    main()
