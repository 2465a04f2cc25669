"""torch.compile(DDP(model)) over the plait backend.

    torchrun --nproc-per-node 2 examples/clients/compile_ddp.py --backend plait
    torchrun --nproc-per-node 2 examples/clients/compile_ddp.py --backend gloo

Nothing in the training code names plait: the backend name is the only change. Dynamo traces
the DDP-wrapped model (DDPOptimizer splits the graph at bucket boundaries) and the gradient
all-reduces run through the backend as usual. --compile-backend aot_eager (or eager) skips code
generation: faster, and dynamo traces the same.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _client import TinyNet, args, emit, global_batch, local_slice


def main():
    a = args(__doc__, steps=6, compile_backend=dict(default="inductor"))
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyNet(hidden=64)
    ddp = DDP(model)
    compiled = torch.compile(ddp, backend=a.compile_backend)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    losses = []
    for step in range(a.steps):
        x, y = global_batch(step, 16 * world)
        opt.zero_grad()
        loss = loss_fn(compiled(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    emit("compile_ddp", a.backend, losses, ddp.module.parameters())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
