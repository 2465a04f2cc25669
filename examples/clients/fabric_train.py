"""Lightning Fabric with DDP over the plait backend (CPU).

    torchrun --nproc-per-node 2 examples/clients/fabric_train.py --backend plait
    torchrun --nproc-per-node 2 examples/clients/fabric_train.py --backend gloo

The one plait line is the strategy:

    from lightning.fabric.strategies import DDPStrategy
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="plait"))
"""

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.strategies import DDPStrategy

from _client import TinyNet, args, emit, global_batch, local_slice


def main():
    a = args(__doc__, steps=6, nproc=dict(type=int, default=2, help="ranks (devices=) when not under torchrun"))
    fabric = L.Fabric(accelerator="cpu", devices=a.nproc, strategy=DDPStrategy(process_group_backend=a.backend))
    fabric.launch()
    torch.manual_seed(0)
    model = TinyNet(hidden=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    rank, world = fabric.global_rank, fabric.world_size
    losses = []
    for step in range(a.steps):
        x, y = global_batch(step, 8 * world)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        fabric.backward(loss)
        opt.step()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    emit("fabric", a.backend, losses, model.module.parameters(), torch_backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
