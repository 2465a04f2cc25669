"""DDP's join context for uneven inputs (`with ddp.join(enable=...)`) over the plait backend.

    torchrun --nproc-per-node 2 examples/clients/ddp_join.py --backend plait             # uneven
    torchrun --nproc-per-node 2 examples/clients/ddp_join.py --backend plait --no-join   # join(enable=False)
    torchrun --nproc-per-node 2 examples/clients/ddp_join.py --backend plait --divide-by-current

With join enabled, rank r trains on steps + r batches: ranks that run out keep shadowing the
others' all-reduces until every rank is done. Code often writes `with model.join(enable=flag)`, so
the disabled form (equal inputs) must behave as if there were no context at all.
--divide-by-current: join(divide_by_initial_world_size=False), gradients averaged over the ranks
that have not joined yet (DDP all-reduces that count in every forward and reads it in backward).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _client import TinyNet, args, emit, global_batch, local_slice


def main():
    a = args(__doc__, steps=4, no_join=dict(action="store_true", help="join(enable=False), equal inputs"),
             divide_by_current=dict(action="store_true", help="join(divide_by_initial_world_size=False)"))
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyNet(hidden=64)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    steps = a.steps if a.no_join else a.steps + rank
    losses = []
    with ddp.join(divide_by_initial_world_size=not a.divide_by_current, enable=not a.no_join):
        for step in range(steps):
            x, y = global_batch(step, 8 * world)
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(local_slice(x, rank, world)), local_slice(y, rank, world))
            loss.backward()
            opt.step()
            losses.append(loss.item())
    emit("ddp_join", a.backend, losses, model.parameters())   # rank 0's own losses
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
