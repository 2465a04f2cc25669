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
