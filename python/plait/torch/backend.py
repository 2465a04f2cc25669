"""The torch.distributed backend "plait": the objects torch sees, and the creator that makes them.

`create` builds one `engine.Group` (a core communicator with its own links) per c10d group and
wraps it in the shell torch expects. `PlaitProcessGroup` (a `dist.ProcessGroup` subclass, torch
2.5+) is the whole group; `PlaitBackend` (a `c10d.Backend` subclass) is one device's backend of a
mixed "cpu:plait,cuda:nccl" group, on torch versions whose C++ calls Python overrides of Backend.
Both take their c10d methods from `methods.Methods`.
"""

import atexit
import datetime
import os
import weakref

import torch
import torch.distributed as dist

from .. import _core
from .._core import PlaitError
from .engine import Group, close_all
from .methods import Methods
from .options import from_pg_options
from .work import PlaitWork, torch_error


class PlaitProcessGroup(Methods, dist.ProcessGroup):
    """A torch ProcessGroup backed by plait."""

    def __init__(self, group, name="", desc="undefined", store=None):
        if store is not None:  # what get_group_store() answers (split_group registers it)
            dist.ProcessGroup.__init__(self, store, group.rank, group.size)
        else:
            dist.ProcessGroup.__init__(self, group.rank, group.size)
        self._g = group
        group.owner = weakref.ref(self)
        self._pl_name = name
        self._pl_desc = desc
        self._pl_backend = None
        # c10d asks groups for their per-device Backend (batch_isend_irecv, DeviceMesh, FSDP...):
        # register a Backend view of this same engine for every device plait serves.
        b = self._pl_backend_view()
        if b is not None:
            bt = getattr(dist.ProcessGroup.BackendType, "CUSTOM", None)
            for dev in ("cpu", "cuda", "mps"):
                try:
                    self._register_backend(torch.device(dev), bt, b)
                except Exception:
                    pass
            try:
                self._set_default_backend(bt)
            except Exception:
                pass

    def _get_backend(self, device=None):
        """The per-device Backend view (c10d asks it e.g. whether it supports coalescing)."""
        b = self._pl_backend_view()
        if b is None:
            return dist.ProcessGroup._get_backend(self, device)
        return b

    def get_backend(self, device=None):
        return self._get_backend(device)

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """`dist.split_group`: a group over `ranks` (ranks of this group, in the new group's
        order) on this group's connections; None on a rank outside it. Every rank of this group
        calls it (torch's split_group does)."""
        ranks = [int(r) for r in ranks]
        if self._g.rank not in ranks:
            return None
        g, store = split(self._g, ranks, timeout, opts, group_name)
        return PlaitProcessGroup(g, group_name or g.group_id, group_desc or "undefined", store=store)

    def _pl_backend_view(self):
        if self._pl_backend is None and PlaitBackend is not None:
            try:
                self._pl_backend = PlaitBackend(self._g, self._pl_name, self._pl_desc, owner=False)
            except Exception:  # pragma: no cover - torch without a constructible Backend
                self._pl_backend = None
        return self._pl_backend

    def __del__(self):
        _shut_down_when_dropped(getattr(self, "_g", None))


def _shut_down_when_dropped(g):
    """An owner dropped without destroy_process_group: close its engine, unless the drop happens
    on the group's own completion thread (which shutdown joins)."""
    if g is not None and not g.closed and not g.completer.in_thread():
        try:
            g.shutdown()
        except Exception:
            pass


_BackendBase = getattr(torch._C._distributed_c10d, "Backend", None)


if _BackendBase is not None:

    class PlaitBackend(Methods, _BackendBase):
        """The per-device form, for mixed groups such as "cpu:plait,cuda:nccl"."""

        def __init__(self, group, name="", desc="undefined", owner=True):
            _BackendBase.__init__(self, group.rank, group.size)
            self._g = group
            self._pl_name = name
            self._pl_desc = desc
            self._pl_owner = owner  # False: a view of a PlaitProcessGroup's engine

        def name(self):
            return "plait"

        @property
        def options(self):
            """torch's Backend.Options of this group (its name and current default timeout)."""
            return _BackendBase.Options("plait", datetime.timedelta(seconds=self._g.timeout))

        # Capability queries: answered in Python (the C++ properties would look for a Python
        # override of the same name and recurse).
        supports_coalescing = property(lambda self: False)
        supports_splitting = property(lambda self: True)
        supports_shrinking = property(lambda self: False)
        supports_reconfigure = property(lambda self: False)
        supports_window = property(lambda self: False)
        supports_abort_hooks = property(lambda self: False)
        _supports_time_estimate = property(lambda self: False)

        def __del__(self):
            if getattr(self, "_pl_owner", False):
                _shut_down_when_dropped(getattr(self, "_g", None))

else:  # pragma: no cover
    PlaitBackend = None


def _next_epoch(store, size):
    """A number every member of this group gets the same value of, different from any earlier
    group built on the same store keys (torch reuses group names after destroy_process_group)."""
    try:
        n = store.add("plait/inits", 1)
    except Exception:
        return 0
    return (int(n) - 1) // max(1, size)


def _shares_group_with_other_backends(dist_backend_opts):
    """Whether torch builds this group with other backends for other devices ("cpu:plait,cuda:nccl"),
    so that plait must be one device's Backend rather than the whole group.

    torch does not pass the device-to-backend map to a creator. torch 2.15 passes the group it is
    building (`process_group`): backends made before this one are registered on it, and its
    default backend type is already set from the map; in a group of plait alone that type is the
    one plait is registered under. What this cannot tell from plait alone gets the whole-group
    form: a torch that passes no group, and a map that names plait first for the device torch
    prefers as the default ("cuda:plait,cpu:gloo") or pairs it with another third-party backend."""
    pg = getattr(dist_backend_opts, "process_group", None)
    if pg is None:
        return False
    try:
        if pg._device_types:
            return True
        default = pg._get_backend_name()
    except Exception:
        return False
    ours = {dist.Backend.backend_type_map.get(name.lower()) for name, plugin in dist.Backend._plugins.items()
            if plugin.creator_fn is create}
    return default not in {t.name.lower() for t in ours if t is not None}


# Groups that opened their own connections (the default group, normally), newest last: later
# groups over some of their ranks share those connections.
_link_owners = []


def _link_owner(ranks):
    """The live group whose connections a new group over global `ranks` can share, if any. Every
    member finds the same one: they created the same groups before, in the same order."""
    if not ranks:
        return None
    for ref in reversed(_link_owners):
        g = ref()
        if g is not None and not g.closed and set(ranks) <= set(g.global_ranks):
            return g
    return None


def create(dist_backend_opts, backend_options=None):
    """The creator torch calls (extended API) for each plait group. A group over ranks of an
    existing plait group (new_group, DeviceMesh, FSDP/HSDP meshes) shares its connections: no
    socket, no probe, no rendezvous beyond torch's own."""
    o = from_pg_options(backend_options).resolved(dist_backend_opts.timeout)
    store = dist_backend_opts.store
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    gid = str(getattr(dist_backend_opts, "group_id", "") or "0")
    ranks = list(getattr(dist_backend_opts, "global_ranks_in_group", []) or [])
    epoch = _next_epoch(store, size)
    owner = None if o.subgroup_links == "own" else _link_owner(ranks)
    try:
        if owner is not None:
            members = [owner.global_ranks.index(r) for r in ranks]
            comm = owner.comm.subgroup(f"torch/{gid}/{epoch}", members, timeout=o.timeout, algo=o.algo)
        else:
            # c10d's contract: every rank issues a group's calls in the same order; torch issues them
            # from several threads (autograd, comm hooks), one at a time, so "creator" would not do.
            comm = _core.Comm(store, rank, size, timeout=o.timeout, group=f"torch/{gid}", epoch=epoch, algo=o.algo,
                              threads="sequential", schedules=o.schedules)
    except PlaitError as e:
        raise torch_error(e) from None
    g = Group(comm, o, gid, ranks, store)
    if owner is None:
        _link_owners[:] = [r for r in _link_owners if r() is not None and not r().closed] + [weakref.ref(g)]
    per_device = _shares_group_with_other_backends(dist_backend_opts) or os.environ.get("PLAIT_TORCH_CLASS") == "backend"
    if per_device and PlaitBackend is not None:
        return PlaitBackend(g, gid)
    return PlaitProcessGroup(g, gid)


def split(parent, ranks, timeout, pg_options, name):
    """The engine of a group split from `parent` (an engine.Group) over its ranks `ranks`, on
    the parent's connections, and its store (a prefix of the parent's)."""
    o = from_pg_options(pg_options).resolved(timeout)
    name = name or f"{parent.group_id}/split{ranks}"
    store = parent.store
    if store is not None:
        store = dist.PrefixStore(f"plait/split/{name}/", store)
    try:
        comm = parent.comm.subgroup(f"split/{name}", ranks, timeout=o.timeout, algo=o.algo)
    except PlaitError as e:
        raise torch_error(e, parent.context()) from None
    return Group(comm, o, name, [parent.global_ranks[r] for r in ranks], store), store


def hide_from_dynamo(*classes):
    """torch.compile must not trace into plait's c10d methods: C++ calls them inside a compiled
    region (DDP's reducer rebuilding its buckets calls broadcast while dynamo traces forward),
    where touching torch's options objects is a hard error. gloo's methods are C++ and opaque
    to dynamo; these are made so by telling dynamo's frame evaluator to run them, and whatever
    they call, as they are. torch._C's evaluator is asked directly: importing torch._dynamo
    would cost seconds. Without that API (another torch), nothing is changed."""
    try:
        from torch._C._dynamo import eval_frame as ef

        skip = ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.SKIP)
        for cls in classes:
            for v in vars(cls).values():
                fn = v.fget if isinstance(v, property) else v
                code = getattr(fn, "__code__", None)
                if code is not None:
                    ef.set_code_exec_strategy(code, skip)
    except Exception:  # pragma: no cover - a torch without this evaluator API
        pass


hide_from_dynamo(Methods, PlaitProcessGroup, PlaitWork, *([PlaitBackend] if PlaitBackend is not None else []))

atexit.register(close_all)
