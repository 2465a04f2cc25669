"""torch on an elastic group (`plait.elastic`): training over whoever is present.

Three ways in, from the least to the most change to a torch training loop:

    import torch.distributed as dist
    import plait.torch.elastic as pe

    pg = pe.init_process_group()                 # joins (PLAIT_JOIN / PLAIT_JOIN_STORE) or founds
    model = pe.DistributedDataParallel(model)    # torch's DDP, averaging over the current members
    while True:
        if pg.update():                          # the update point: joiners come in, rank/size move
            model.sync_parameters()              # joiners take the most senior member's weights
        loss = model(batch).loss
        loss.backward()                          # buckets averaged over the members present
        if pg.should_commit():                   # the same answer on every member
            optimizer.step()
        optimizer.zero_grad()

After `init_process_group()`, `dist.get_rank()`, `dist.get_world_size()` and every `dist.*`
collective without `group=` run on plait's current view (`ElasticProcessGroup`); a collective that
loses a member raises `plait.PeerLost` on every member with its outputs as they were. Without
DDP, `GradientAverager` averages a model's gradients over the numpy API:

    comm = plait.elastic.join()
    avg = GradientAverager(comm, model)
    while True:
        if comm.update():
            avg.sync_parameters()
        loss = model(batch).loss
        loss.backward()
        avg.step(optimizer)                      # average, then step only if every member can

Gradients are averaged in place over the members of the current view (a member lost meanwhile:
retried over the new view, so "avg" divides by those that took part); the optimizer steps only
if every member's step went well (`should_commit`), the same on every member. Parameters and
gradients must be CPU tensors.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .._core import PeerLost
from ..elastic import ElasticCommunicator, join
from .elastic_group import ElasticProcessGroup, install_as_default

__all__ = ["init_process_group", "ElasticProcessGroup", "DistributedDataParallel", "GradientAverager"]


def init_process_group(comm: Optional[ElasticCommunicator] = None, **join_args: Any) -> ElasticProcessGroup:
    """Makes an elastic group torch's default process group and returns it: `comm`, or the group
    `plait.elastic.join(**join_args)` joins or founds (PLAIT_JOIN, PLAIT_JOIN_STORE...: the same
    settings). No torchrun, no MASTER_ADDR: `plait run` or plain `python train.py` on each machine.
    `dist.destroy_process_group()` leaves the group."""
    pg = ElasticProcessGroup(comm if comm is not None else join(**join_args))
    try:
        install_as_default(pg)
    except BaseException:
        pg.elastic.close()
        raise
    return pg


def _default_group() -> ElasticProcessGroup:
    pg = dist.group.WORLD if dist.is_initialized() else None
    if not isinstance(pg, ElasticProcessGroup):
        raise RuntimeError("plait.torch.elastic: no elastic default group; call plait.torch.elastic.init_process_group() "
                           "or pass group=")
    return pg


def _retried(call):
    """Runs `call()` (a collective over the current view) until it completes: a member lost
    meanwhile fails it everywhere with the buffers as they were, and it runs again over the new
    view, on every member alike."""
    while True:
        try:
            return call()
        except PeerLost:
            continue


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's DistributedDataParallel, with each gradient bucket averaged over the current
    members of an elastic group (`group`, default: the elastic default group).

    torch's DDP talks to its process group when it is built (a broadcast of the weights, a check
    of the shapes) and after its first step (it reorders its buckets): in an elastic group a
    joiner builds its DDP while the members train, so those calls would not pair up. So the DDP
    runs over a group of one, and its buckets reach the members through a communication hook;
    it never reorders its buckets (as torchft's DDP does), so every member's buckets hold the
    same parameters in the same order. Weights are shared with `sync_parameters()` at an update
    point; steps are agreed with `should_commit()`."""

    def __init__(self, module: torch.nn.Module, group: Optional[ElasticProcessGroup] = None, **ddp_args: Any):
        group = group if group is not None else _default_group()
        for p in module.parameters():
            if p.device.type != "cpu":
                raise ValueError(f"plait DistributedDataParallel: a parameter is on {p.device}; elastic mode averages CPU tensors")
        ddp_args.setdefault("find_unused_parameters", True)  # True: the buckets are never rebuilt
        if not ddp_args["find_unused_parameters"] or ddp_args.get("static_graph"):
            raise ValueError("plait DistributedDataParallel: find_unused_parameters must stay True and static_graph False "
                             "(either lets DDP reorder its buckets after the first step, on each member at its own time)")
        super().__init__(module, process_group=_solo_group(), **ddp_args)
        self.elastic_group = group
        self.register_comm_hook(group, _average_over_members)

    def should_commit(self, ok: bool = True) -> bool:
        return self.elastic_group.should_commit(ok)

    @torch.no_grad()
    def sync_parameters(self) -> None:
        """Every member takes the parameters and buffers of the most senior member (rank 0): call
        it after `update()` returns True, so that joiners start from the group's weights."""
        sync_from_senior(list(self.module.parameters()) + list(self.module.buffers()), self.elastic_group)


def _average_over_members(group, bucket):  # no annotations: DDP checks them against its own classes
    buf = bucket.buffer()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    _retried(lambda: group.allreduce([buf], opts).wait())
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _by_dtype(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """`tensors` grouped by dtype (one collective each), the groups in the same order on every
    member."""
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return [groups[d] for d in sorted(groups, key=str)]


@torch.no_grad()
def _unflatten(flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


@torch.no_grad()
def sync_from_senior(tensors: List[torch.Tensor], group: ElasticProcessGroup) -> None:
    """Every member takes the values of `tensors` from the most senior member (rank 0 of the
    view the broadcast completes in); one broadcast per dtype."""
    for ts in _by_dtype(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        _retried(lambda: group.broadcast([flat], opts).wait())
        _unflatten(flat, ts)


_solo = []


def _solo_group() -> "dist.ProcessGroup":
    """A torch group of this process alone, for the calls DDP makes on its own group."""
    if not _solo:
        store = dist.HashStore()
        backend = dist.ProcessGroupGloo(store, 0, 1)
        pg = dist.ProcessGroup(store, 0, 1)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        _solo.append(pg)
    return _solo[0]


class GradientAverager:
    def __init__(self, comm: ElasticCommunicator, model: torch.nn.Module):
        self.comm = comm
        self.params: List[torch.nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.device.type != "cpu":
                raise ValueError(f"GradientAverager: a parameter is on {p.device}; elastic mode averages CPU tensors")

    def average(self) -> bool:
        """Averages every parameter's gradient over the current members (one allreduce per
        dtype); a parameter without a gradient counts as zeros. False if it could not be done."""
        for ps in _by_dtype(self.params):
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            self.comm.allreduce_with_retry(flat.numpy(), "avg", out=flat.numpy())
            _unflatten(flat, [p.grad for p in ps])
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
        for ps in _by_dtype(self.params):
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            _retried(lambda: self.comm.broadcast(flat.numpy(), 0))  # a failed one leaves `flat` as it was
            _unflatten(flat, ps)
