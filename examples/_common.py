"""Shared bits of the examples: a tiny model, a synthetic dataset, and a reference trainer."""

import torch
import torch.nn as nn


class TinyNet(nn.Module):
    """A small MLP regressor: big enough for several DDP buckets, small enough for a laptop."""

    def __init__(self, d_in=32, hidden=256, d_out=8, depth=3):
        super().__init__()
        layers = [nn.Linear(d_in, hidden), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.GELU()]
        layers += [nn.Linear(hidden, d_out)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def global_batch(step, batch, d_in=32, d_out=8, seed=1234):
    """The step's global batch (the same on every rank; each rank trains on its slice)."""
    g = torch.Generator().manual_seed(seed + step)
    x = torch.randn(batch, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(seed))
    y = torch.tanh(x @ w) + 0.05 * torch.randn(batch, d_out, generator=g)
    return x, y


def local_slice(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def report_step(step, loss, dt, rank, world):
    """Rank 0 prints the loss averaged over the ranks (an all_reduce: every rank must call it)."""
    import torch.distributed as dist

    avg = loss.detach().float().clone()
    dist.all_reduce(avg)
    if rank == 0:
        print(f"step {step:3d}  loss {avg.item() / world:.6f}  {dt * 1000:7.2f} ms", flush=True)


def reference_step(ref, ropt, loss_fn, x, y):
    """One step of the single-process reference on the whole batch (for --check)."""
    if ref is None:
        return
    ropt.zero_grad()
    loss_fn(ref(x), y).backward()
    ropt.step()
