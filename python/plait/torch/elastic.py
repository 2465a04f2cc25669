"""torch on an elastic group (`plait.elastic`): training over whoever is present.

Three ways in, from the least to the most change to a torch training loop:

    import torch.distributed as dist
    import plait.torch.elastic as pe

    pg = pe.init_process_group()                 # joins (PLAIT_JOIN / PLAIT_JOIN_STORE) or founds
    model = pe.DistributedDataParallel(model)    # torch's DDP, averaging over the current members
    optimizer = torch.optim.AdamW(model.parameters())
    state = pe.TrainingState(model, optimizer)   # weights, optimizer state (and counters: extra=)
    while True:
        if pg.update():                          # the update point: joiners come in, rank/size move
            state.sync(pg)                       # bit-identical everywhere; joiners download it, striped
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

`TrainingState(model, optimizer, **extra)` is what a joiner needs to train in step with the
members, as shared state (`plait.elastic.SharedState`): the parameters and buffers, the
optimizer's state (Adam's moments and step counts...) and extra tensors such as a step counter.
`sync()` makes it bit-identical on every member; a joiner downloads it striped over the members.
Without the optimizer's state a joiner's Adam would start from zero moments and its weights
would drift from the members' (`sync_parameters()` shares the weights only: enough for SGD
without momentum).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import numpy as np

from .._core import InvalidArgumentError, PeerLost
from .._shared_state import SharedState
from ..elastic import ElasticCommunicator, join
from .elastic_group import ElasticProcessGroup, install_as_default

__all__ = ["init_process_group", "ElasticProcessGroup", "DistributedDataParallel", "GradientAverager", "TrainingState"]


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


class TrainingState:
    """The model's parameters and buffers, the optimizer's state and hyperparameters, and `extra`
    tensors (CPU, used in place; a step counter, say, from which an LR scheduler's `last_epoch`
    can be set on a joiner) as one shared state.
    `sync(group)` (a collective: every member calls it at the same point, after `update()`
    returned True) makes it bit-identical on every member: the state most members hold wins,
    joiners download it striped over the members, every chunk hash-checked
    (`ElasticCommunicator.sync_shared_state`).

    torch optimizers create a parameter's state at the first step that parameter has a gradient,
    so a joiner has none while the members have theirs. `sync` first finds out (one allreduce of
    a flag per parameter) which parameters some member has state for; a member that lacks it
    creates it (a step on zero gradients for those parameters only; its parameters and gradients
    are put back) so that every member's state has the same layout, and then receives the values.
    The numeric hyperparameters of each parameter group (`lr` as a scheduler sets it, betas,
    weight decay...) are shared too. Optimizer state that is not a tensor is refused. Every member
    must build its model and optimizer alike (the same parameters, the same names)."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 **extra: torch.Tensor) -> None:
        self.model, self.optimizer, self.extra = model, optimizer, dict(extra)
        self._state: Optional[SharedState] = None
        self._key = None
        self._hyper = torch.zeros(0, dtype=torch.float64)

    def _optimizer_params(self) -> List[Tuple[str, torch.Tensor]]:
        """Every parameter the optimizer holds, with a name: the model's name for it, else its
        place in the optimizer."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [(names.get(id(p), f"group {i} index {j}"), p) for i, group in enumerate(self.optimizer.param_groups)
                for j, p in enumerate(group["params"])]

    def _hyperparameters(self) -> List[Tuple[int, str, int]]:
        """(group, key, position) of every number in the parameter groups' settings (a tuple such
        as betas gives one per item); booleans are left out."""
        out = []
        for i, group in enumerate(self.optimizer.param_groups):
            for key in sorted(k for k in group if k != "params"):
                v = group[key]
                items = v if isinstance(v, (tuple, list)) else (v,)
                if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items) and items:
                    out.extend((i, key, k) for k in range(len(items)))
        return out

    def _arrays(self) -> Dict[str, torch.Tensor]:
        arrays: Dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            arrays[f"parameter {name}"] = p.data
        for name, b in self.model.named_buffers():
            arrays[f"buffer {name}"] = b
        if self.optimizer is not None:
            in_model = {id(p) for p in self.model.parameters()}
            for label, p in self._optimizer_params():
                if id(p) not in in_model:
                    arrays[f"parameter {label}"] = p.data
                for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                    if not torch.is_tensor(value):
                        raise InvalidArgumentError(f"TrainingState: the optimizer's state {key!r} of {label} is a "
                                                   f"{type(value).__name__}, not a tensor: it cannot be shared")
                    arrays[f"optimizer {label} {key}"] = value
            arrays["optimizer hyperparameters"] = self._hyper
        for name, t in self.extra.items():
            arrays[f"extra {name}"] = t
        for name, t in arrays.items():
            if t.device.type != "cpu":
                raise InvalidArgumentError(f"TrainingState: {name!r} is on {t.device}; shared state is held in CPU memory")
        return arrays

    @torch.no_grad()
    def _create_optimizer_state(self, params: List[torch.Tensor]) -> None:
        """A step on zero gradients for `params` (the others without gradients) creates their
        state; the parameters and gradients are put back. The state's values are the members'
        once synced (a step's worth of state is left rather than zeros, which some optimizers
        would never move from)."""
        every = [p for _, p in self._optimizer_params()]
        saved = [(p.detach().clone(), p.grad) for p in every]
        wanted = {id(p) for p in params}
        for p in every:
            p.grad = torch.zeros_like(p) if id(p) in wanted else None
        self.optimizer.step()
        for p, (data, grad) in zip(every, saved):
            p.copy_(data)
            p.grad = grad

    def sync(self, group: Any) -> dict:
        """Makes the state bit-identical on every member (`group`: an `ElasticProcessGroup` or an
        `ElasticCommunicator`); returns `sync_shared_state`'s report."""
        comm = getattr(group, "elastic", group)
        if self.optimizer is not None:
            params = [p for _, p in self._optimizer_params()]
            mine = np.array([1 if self.optimizer.state.get(p) else 0 for p in params], np.int64)
            anyone = _retried(lambda: self._max_flags(comm, mine))
            missing = [p for p, m, a in zip(params, mine, anyone) if a and not m]
            if missing:
                self._create_optimizer_state(missing)
            hyper = self._hyperparameters()
            values = [self.optimizer.param_groups[i][k] for i, k, _ in hyper]
            now = torch.tensor([float(v[j] if isinstance(v, (tuple, list)) else v) for v, (_, _, j) in zip(values, hyper)],
                               dtype=torch.float64)
            if now.shape == self._hyper.shape:
                self._hyper.copy_(now)  # the same storage: the shared state is not rebuilt
            else:
                self._hyper = now
        report = comm.sync_shared_state(self.shared_state())
        if self.optimizer is not None:
            self._set_hyperparameters(hyper)
        return report

    def _set_hyperparameters(self, hyper: List[Tuple[int, str, int]]) -> None:
        got = self._hyper.tolist()
        for (i, key, j), v in zip(hyper, got):
            group = self.optimizer.param_groups[i]
            old = group[key]
            if isinstance(old, (tuple, list)):
                items = list(old)
                items[j] = type(old[j])(v)
                group[key] = type(old)(items)
            else:
                group[key] = type(old)(v)

    def shared_state(self) -> SharedState:
        """The `SharedState` over the tensors as they are now (rebuilt when the optimizer's state
        or a tensor's storage changed; a member that voted goes on voting)."""
        arrays = self._arrays()
        key = tuple((n, t.data_ptr(), t.dtype, tuple(t.shape)) for n, t in sorted(arrays.items()))
        if key != self._key:
            synced = self._state is not None and self._state.synced
            self._state, self._key = SharedState(arrays), key
            self._state.synced = synced
        return self._state

    def digest(self) -> str:
        """The hash of the whole state (equal on two members exactly when bit-identical)."""
        return self.shared_state().digest()

    @staticmethod
    def _max_flags(comm: ElasticCommunicator, flags: np.ndarray) -> np.ndarray:
        a = flags.copy()
        comm.allreduce(a, "max", out=a)
        return a
