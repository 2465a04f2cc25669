"""What every client script shares: the command line, the synthetic data, and the one result line.

Each client trains a small model for a few steps on CPU and rank 0 prints one line

    RESULT {"client": ..., "backend": ..., "world": ..., "losses": [...], "checksum": ...}

with the loss of every step (averaged over ranks where the framework logs it so) and the sum of
the final parameters. tests/torch/test_clients.py runs each client with plait and with gloo and
compares the two lines.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import TinyNet, global_batch, local_slice  # noqa: E402,F401


def args(doc, steps=8, **extra):
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="plait", help="plait or gloo (or any registered backend)")
    ap.add_argument("--steps", type=int, default=steps)
    for name, kw in extra.items():
        ap.add_argument("--" + name.replace("_", "-"), **kw)
    a = ap.parse_args()
    if "plait" in a.backend:
        import plait.torch  # noqa: F401  registers "plait" (newer torch finds it by itself)
    return a


def checksum(params):
    """The sum of every parameter (float64), and of their absolute values: equal runs give equal sums."""
    import torch

    params = list(params)
    s = sum(p.detach().double().sum().item() for p in params)
    a = sum(p.detach().double().abs().sum().item() for p in params)
    return [s, a]


def emit(client, backend, losses, params, rank=None, world=None, **more):
    """Rank 0 prints the RESULT line (other ranks print nothing). Every rank must call it while the
    default group exists: `in_sync` says whether every rank ended with the same parameters."""
    import torch.distributed as dist

    params = list(params)
    if dist.is_initialized():
        sums = [None] * dist.get_world_size()
        dist.all_gather_object(sums, checksum(params))
        more["in_sync"] = all(s == sums[0] for s in sums)
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if rank != 0:
        return
    out = dict(client=client, backend=backend, world=world, losses=[float(x) for x in losses],
               checksum=checksum(params), **more)
    print("RESULT " + json.dumps(out), flush=True)
