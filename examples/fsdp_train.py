"""FSDP2 (`fully_shard`) training with the plait backend; --hsdp for a 2-D mesh (replicate x shard).

    torchrun --nproc-per-node 3 examples/fsdp_train.py --backend plait
    torchrun --nproc-per-node 4 examples/fsdp_train.py --backend plait --hsdp     # 2x2 mesh
    torchrun --nproc-per-node 3 examples/fsdp_train.py --backend gloo

FSDP2 all-gathers parameters and reduce-scatters gradients (with AVG or PREMUL_SUM) through the
group; the DeviceMesh's groups are plait groups too. With --check, every rank also trains a
single-process copy and compares the full (unsharded) parameters at the end.
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
from _common import TinyNet, global_batch, local_slice, reference_step, report_step  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="plait")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--hsdp", action="store_true", help="2-D mesh: replicate over nodes, shard within")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()

    if "plait" in a.backend:
        import plait.torch  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.hsdp:
        if world % 2:
            raise SystemExit("--hsdp needs an even number of ranks")
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model) if a.check else None
    for layer in model.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3) if ref is not None else None
    loss_fn = nn.MSELoss()
    if rank == 0:
        print(f"backend={a.backend} world={world} mesh={tuple(mesh.shape)}")
    for step in range(a.steps):
        x, y = global_batch(step, a.batch)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        report_step(step, loss, dt, rank, world)
        reference_step(ref, ropt, loss_fn, x, y)
    if ref is not None:
        worst = 0.0
        for p, q in zip(model.parameters(), ref.parameters()):
            worst = max(worst, (p.full_tensor() - q).abs().max().item())
        ok = worst < 1e-5
        print(f"rank {rank}: FSDP2 vs single process: max |diff| = {worst:.3g} -> {'OK' if ok else 'MISMATCH'}", flush=True)
        if not ok:
            sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
