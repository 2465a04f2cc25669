"""DistributedDataParallel training with the plait backend (or any other, for comparison).

    torchrun --nproc-per-node 3 examples/ddp_train.py --backend plait
    torchrun --nproc-per-node 3 examples/ddp_train.py --backend gloo
    torchrun --nproc-per-node 3 examples/ddp_train.py --backend plait --check   # vs 1 process
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:29500 examples/ddp_train.py

The only plait-specific lines are `import plait.torch` and the backend name. Rank 0 prints the
loss (averaged over ranks) and the time of each step. With --check, every rank also trains a
single-process copy on the whole global batch and verifies that DDP reached the same parameters.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import TinyNet, global_batch, local_slice, reference_step, report_step  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="plait")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=96, help="global batch (split across ranks)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--bucket-mb", type=float, default=0.25)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--check", action="store_true", help="compare with single-process training")
    a = ap.parse_args()

    if "plait" in a.backend:
        import plait.torch  # noqa: F401  registers the "plait" backend
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    model = TinyNet(hidden=a.hidden).to(dtype)
    ref = None
    ropt = None
    if a.check:
        import copy

        ref = copy.deepcopy(model)
        ropt = torch.optim.SGD(ref.parameters(), lr=a.lr)
    ddp = DDP(model, bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    loss_fn = nn.MSELoss()
    if rank == 0:
        print(f"backend={a.backend} world={world} params={sum(p.numel() for p in model.parameters())} dtype={a.dtype}")
    for step in range(a.steps):
        x, y = global_batch(step, a.batch)
        x, y = x.to(dtype), y.to(dtype)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(ddp(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        report_step(step, loss, dt, rank, world)
        reference_step(ref, ropt, loss_fn, x, y)
    if ref is not None:
        tol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-5, 1e-6)
        worst = max((p.detach().float() - q.detach().float()).abs().max().item()
                    for p, q in zip(ddp.module.parameters(), ref.parameters()))
        ok = all(torch.allclose(p.float(), q.float(), rtol=tol[0], atol=tol[1])
                 for p, q in zip(ddp.module.parameters(), ref.parameters()))
        print(f"rank {rank}: DDP vs single process: max |diff| = {worst:.3g} -> {'OK' if ok else 'MISMATCH'}", flush=True)
        if not ok:
            sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
