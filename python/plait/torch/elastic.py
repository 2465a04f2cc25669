"""DDP-style training over whoever is present, on an elastic group (`plait.elastic`).

    import plait.elastic
    from plait.torch.elastic import GradientAverager

    comm = plait.elastic.join()                  # PLAIT_JOIN names a member to join through
    avg = GradientAverager(comm, model)
    while True:
        if comm.update():                        # members joined or left
            avg.sync_parameters()                # joiners take the most senior member's weights
        loss = model(batch).loss
        loss.backward()
        avg.step(optimizer)                      # average, then step only if every member can

Gradients are averaged in place over the members of the current view (a member lost meanwhile:
retried over the new view, so "avg" divides by those that took part); the optimizer steps only
if every member's step went well (`should_commit`), the same on every member. Parameters and
gradients must be CPU tensors of a dtype numpy has (float16, float32, float64).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from .._core import PeerLost
from ..elastic import ElasticCommunicator


class GradientAverager:
    def __init__(self, comm: ElasticCommunicator, model: torch.nn.Module):
        self.comm = comm
        self.params: List[torch.nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.device.type != "cpu":
                raise ValueError(f"GradientAverager: a parameter is on {p.device}; elastic mode averages CPU tensors")

    def _groups(self) -> Dict[torch.dtype, List[torch.Tensor]]:
        groups: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in self.params:
            groups.setdefault(p.dtype, []).append(p)
        return groups

    def average(self) -> bool:
        """Averages every parameter's gradient over the current members (one allreduce per
        dtype); a parameter without a gradient counts as zeros. False if it could not be done."""
        for dtype, ps in self._groups().items():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
            self.comm.allreduce_with_retry(flat.numpy(), "avg", out=flat.numpy())
            at = 0
            for p in ps:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[at:at + n].view_as(p))
                at += n
        return True

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """`average()`, then `optimizer.step()` only if every member's step went well; gradients
        are zeroed either way. Returns whether the step was taken (the same on every member)."""
        try:
            ok = self.average()
        except Exception:
            ok = False
        commit = self.comm.should_commit(ok)
        if commit:
            optimizer.step()
        optimizer.zero_grad()
        return commit

    @torch.no_grad()
    def sync_parameters(self) -> None:
        """Every member takes the parameters of the most senior member (rank 0): call it after
        `update()` returns True, so that joiners start from the group's weights."""
        for dtype, ps in self._groups().items():
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            while True:
                try:
                    self.comm.broadcast(flat.numpy(), 0)
                    break
                except PeerLost:
                    flat = torch.cat([p.detach().reshape(-1) for p in ps])  # rank 0 may be another member now
            at = 0
            for p in ps:
                n = p.numel()
                p.copy_(flat[at:at + n].view_as(p))
                at += n
