"""A 2-stage pipeline with torch.distributed.pipelining over the plait backend.

    torchrun --nproc-per-node 2 examples/pipeline_train.py --backend plait
    torchrun --nproc-per-node 2 examples/pipeline_train.py --backend plait --schedule 1f1b --check

Rank 0 holds the first half of the layers, rank 1 the second; activations and gradients travel
between them with send/recv (batch_isend_irecv). With --check, rank 1 sends its trained stage to
rank 0, which compares the whole model with a single-process copy trained on the same batches.
"""

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import TinyNet, global_batch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="plait")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()

    if "plait" in a.backend:
        import plait.torch  # noqa: F401
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("this example has exactly 2 stages: run it with --nproc-per-node 2")
    torch.manual_seed(0)
    full = TinyNet(depth=4)
    ref = copy.deepcopy(full) if a.check and rank == 0 else None
    layers = list(full.net)
    half = len(layers) // 2
    part = nn.Sequential(*(layers[:half] if rank == 0 else layers[half:]))
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    loss_fn = nn.MSELoss()
    sched_cls = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
    schedule = sched_cls(stage, a.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05) if ref is not None else None
    if rank == 0:
        print(f"backend={a.backend} stages=2 microbatches={a.microbatches} schedule={a.schedule}")
    for step in range(a.steps):
        x, y = global_batch(step, a.batch)
        t0 = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            losses = []
            schedule.step(target=y, losses=losses)
        opt.step()
        dt = time.perf_counter() - t0
        if rank == 1:
            print(f"step {step:3d}  loss {torch.stack(losses).mean().item():.6f}  {dt * 1000:7.2f} ms", flush=True)
        if ref is not None:
            # The pipeline averages micro-batch losses: the same gradient as the mean loss.
            ropt.zero_grad()
            loss_fn(ref(x), y).backward()
            ropt.step()
    if a.check:
        flat = torch.cat([p.detach().reshape(-1) for p in part.parameters()])
        n = torch.tensor([flat.numel()])
        if rank == 1:
            dist.send(n, 0)
            dist.send(flat, 0)
        else:
            dist.recv(n, 1)
            tail = torch.empty(int(n.item()))
            dist.recv(tail, 1)
            got = torch.cat([flat, tail])
            want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
            worst = (got - want).abs().max().item()
            ok = worst < 1e-5
            print(f"pipeline vs single process: max |diff| = {worst:.3g} -> {'OK' if ok else 'MISMATCH'}", flush=True)
            if not ok:
                sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
