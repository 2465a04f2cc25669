"""A torch ProcessGroup over an elastic plait group: its rank and size are those of plait's
current view, and change between epochs.

It is the static backend's torch shell (`backend.PlaitProcessGroup`, every c10d method of
`methods.Methods`) on an engine whose core is an elastic member instead of a static
communicator. What changes:

- `rank()` and `size()` (and so `dist.get_rank()`, `dist.get_world_size()`, the checks of
  `all_gather`'s list length...) read the view at each call;
- every operation runs on the caller's thread and is complete when the call returns (elastic
  mode runs blocking operations; an `async_op=True` call returns a completed Work);
- a call made of several core operations (an `all_gather` into a list, a coalesced call) either
  completes or fails as a whole: its outputs are put back when any part fails, as the core does
  for one operation;
- point-to-point calls and subgroups are refused: calls must pair up across view changes.

A collective that loses a member fails on every member with `plait.PeerLost` (also a
`dist.DistBackendError`), raised at `wait()` (at the call for blocking calls), with the outputs as
they were; the next call runs over the new view.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .._core import InvalidArgumentError, PlaitError
from . import skip_torch_flight_recorder_hook
from .backend import PlaitProcessGroup
from .engine import Group, issue
from .options import from_pg_options
from .work import torch_error

BACKEND_NAME = "plait-elastic"


class _ElasticCore:
    """What `engine.Group` asks of its core communicator, answered by an elastic member."""

    def __init__(self, core):
        self._e = core

    rank = property(lambda self: self._e.rank)
    size = property(lambda self: self._e.size)
    timeout = property(lambda self: self._e.timeout)

    def collective(self, *args, inline=True, **kw):
        return self._e.collective(*args, inline=True, **kw)

    def barrier(self, timeout=None, inline=True):
        flag = torch.zeros(1, dtype=torch.uint8)
        p = flag.data_ptr()
        return self._e.collective("allreduce", p, 1, p, 1, "u8", "max", timeout=timeout)

    def _refuse_p2p(self, *a, **k):
        raise InvalidArgumentError("point-to-point calls are not offered in elastic mode: every member's calls must "
                                   "pair up across view changes, and a peer's rank changes with the view")

    send = recv = _refuse_p2p

    def subgroup(self, *a, **k):
        raise InvalidArgumentError("subgroups are not offered in elastic mode")

    def refuse(self, reason):
        # The elastic core cannot tell the others that this member skipped a call; the refusal
        # stays local (docs/elastic.md, "Not built yet").
        pass

    def abort(self, reason):
        self._e.close()

    def close(self):
        self._e.close()


class ElasticGroup(Group):
    """The engine of an elastic process group: rank and size follow the view."""

    def _take_identity(self, comm):
        pass

    rank = property(lambda self: self.comm.rank)
    size = property(lambda self: self.comm.size)

    def runs_inline(self, opts, ops):
        return True

    def context(self):
        e = self.comm._e
        return f"elastic group, member {e.member_id}, rank {e.rank} of {e.size} in epoch {e.epoch}"


class ElasticProcessGroup(PlaitProcessGroup):
    """A torch ProcessGroup over the members of an elastic plait group (`plait.elastic.join`).

    Use it as any group (`dist.all_reduce(t, group=pg)`), or make it torch's default group with
    `plait.torch.elastic.init_process_group()`. `update()`, `pending()`, `should_commit()`,
    `epoch` and `members` are those of the elastic communicator (`pg.elastic`)."""

    def __init__(self, elastic):
        self.elastic = elastic
        opts = from_pg_options(None).resolved(datetime.timedelta(seconds=elastic._comm.timeout))
        g = ElasticGroup(_ElasticCore(elastic._comm), opts, "elastic", [])
        g.check = None  # the DETAIL check runs over a static subgroup: not in elastic mode
        super().__init__(g, BACKEND_NAME, "elastic")

    def getBackendName(self):
        return BACKEND_NAME

    _get_backend_name = getBackendName

    def __repr__(self):
        return f"<plait elastic ProcessGroup: rank {self._g.rank} of {self._g.size}, epoch {self.epoch}>"

    @property
    def epoch(self):
        return self.elastic.epoch

    @property
    def members(self):
        return self.elastic.members

    def update(self):
        """The update point (`ElasticCommunicator.update`): waiting joiners come in here; True if
        the view changed, so rank and size may have."""
        return self.elastic.update()

    def pending(self):
        return self.elastic.pending()

    def should_commit(self, ok=True):
        return self.elastic.should_commit(ok)

    def split_group(self, *a, **k):
        raise torch_error(InvalidArgumentError("split_group is not offered in elastic mode"))

    def _issue(self, what, opts, outputs, inputs, plan):
        saved = []

        def planned(st):
            ops = plan(st)
            if len(ops) > 1:  # one core operation restores its own output; several need this
                saved.extend((t, t.clone()) for t in _tensors(outputs))
            return ops

        w = issue(self._g, self._pl_name, what, opts, outputs, inputs, planned)
        if saved and any(_failed(p) for p in w._parts):
            with torch.no_grad():
                for t, copy in saved:
                    t.copy_(copy)
        return w


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _failed(part):
    try:
        part.wait(0.001)
    except PlaitError:
        return True
    return False


_installing = []  # the group init_process_group is installing, for the creator torch calls


def _creator(store, rank, size, timeout):
    if not _installing:  # dist.new_group: ranks of a view do not last
        raise torch_error(InvalidArgumentError("new_group is not offered in elastic mode: a peer's rank changes with the view"))
    return _installing[-1]


def install_as_default(pg: ElasticProcessGroup) -> None:
    """Makes `pg` torch's default process group, so that calls without `group=` use it."""
    if dist.is_initialized():
        raise torch_error(InvalidArgumentError("a default process group exists already: "
                                               "call dist.destroy_process_group() first"))
    if BACKEND_NAME.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(BACKEND_NAME, _creator, devices=["cpu"])
        skip_torch_flight_recorder_hook(BACKEND_NAME)
    # torch's bookkeeping wants a rank and a size for the group it registers; the group itself
    # answers rank() and size() from the view at every call.
    _installing.append(pg)
    try:
        dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=0, world_size=1)
    finally:
        _installing.pop()
