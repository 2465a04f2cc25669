"""HF Accelerate over the plait backend (CPU).

    torchrun --nproc-per-node 2 examples/clients/accelerate_train.py --backend plait
    torchrun --nproc-per-node 2 examples/clients/accelerate_train.py --backend gloo

On CPU, Accelerate picks gloo (or mpi) itself and refuses any other name given through
InitProcessGroupKwargs(backend=...). It uses the default process group if one exists, so the
working way is to create that group first and name no backend to Accelerate:

    import torch.distributed as dist
    dist.init_process_group("plait")          # before the Accelerator
    accelerator = Accelerator(cpu=True)        # no backend named

Accelerate then reports `accelerator.state.backend == "gloo"` (its own guess; it never calls
init_process_group), while every collective goes through the group made above:
`dist.get_backend() == "plait"`.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from _client import TinyNet, args, emit, global_batch


def main():
    a = args(__doc__, steps=6)
    dist.init_process_group(a.backend)
    accelerator = Accelerator(cpu=True)
    assert dist.get_backend() == a.backend, (dist.get_backend(), a.backend)
    assert accelerator.num_processes == dist.get_world_size()
    torch.manual_seed(0)
    model = TinyNet(hidden=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    world = accelerator.num_processes
    xs, ys = zip(*(global_batch(step, 8 * world) for step in range(a.steps)))
    data = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8, shuffle=False)
    model, opt, data = accelerator.prepare(model, opt, data)   # DDP; each rank gets its shard of a batch
    loss_fn = nn.MSELoss()
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        opt.step()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    emit("accelerate", a.backend, losses, accelerator.unwrap_model(model).parameters(),
         accelerate_backend=accelerator.state.backend, torch_backend=dist.get_backend(),
         distributed_type=str(accelerator.distributed_type))
    accelerator.end_training()                  # destroys the process group


if __name__ == "__main__":
    main()
