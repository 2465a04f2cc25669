"""torchtitan-style code over the plait backend: a DeviceMesh, FSDP2 (fully_shard), optionally
tensor parallelism on a second mesh dimension, and a DCP checkpoint saved and loaded back.

    torchrun --nproc-per-node 2 examples/clients/devicemesh_fsdp2_dcp.py --backend plait
    torchrun --nproc-per-node 2 examples/clients/devicemesh_fsdp2_dcp.py --backend plait --tp 2
    torchrun --nproc-per-node 2 examples/clients/devicemesh_fsdp2_dcp.py --backend gloo

The plait lines:

    dist.init_process_group("plait")                                  # the mesh uses this backend
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))

Every mesh dimension's group is a plait group (made with new_group, sharing the default group's
connections). After training, the sharded state is saved with torch.distributed.checkpoint, loaded
into a freshly initialised copy, and the loaded parameters must equal the trained ones.
"""

import atexit
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from _client import args, emit, global_batch, local_slice


class Block(nn.Module):
    def __init__(self, d=32, hidden=64):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, d=32, depth=2, d_out=8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(mesh, tp, seed):
    torch.manual_seed(seed)
    model = Model()
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def full(params):
    return [p.full_tensor() if isinstance(p, DTensor) else p for p in params]


def main():
    a = args(__doc__, steps=6, tp=dict(type=int, default=1, help="tensor-parallel degree (a 2-D mesh)"),
             ckpt=dict(default=None, help="checkpoint directory (default: a fresh temporary one)"))
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // a.tp
    mesh = init_device_mesh("cpu", (dp, a.tp), mesh_dim_names=("dp", "tp"))
    model = build(mesh, a.tp, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for step in range(a.steps):
        x, y = global_batch(step, 8 * dp)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(local_slice(x, dp_rank, dp)), local_slice(y, dp_rank, dp))
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    trained = [t.detach().clone() for t in full(model.parameters())]

    ckpt = a.ckpt
    if ckpt is None:
        ckpt = [tempfile.mkdtemp(prefix="plait-dcp-") if rank == 0 else None]
        dist.broadcast_object_list(ckpt, src=0)
        ckpt = ckpt[0]
        if rank == 0:
            atexit.register(shutil.rmtree, ckpt, True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    fresh = build(mesh, a.tp, seed=1)                   # other initial values
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    fresh.load_state_dict(state["model"])
    loaded = full(fresh.parameters())
    dcp_ok = all(torch.equal(p, q) for p, q in zip(trained, loaded))
    emit("devicemesh_fsdp2_dcp", a.backend, losses, trained, dcp_roundtrip=dcp_ok, mesh=[dp, a.tp])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
