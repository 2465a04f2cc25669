"""Elastic mode: members join and leave while the others train, and no process is special.

    import plait.elastic
    comm = plait.elastic.join()                    # founds a group; give comm.contact to others
    comm = plait.elastic.join(["10.0.0.1:29400"])  # joins the group of that member

    while True:
        comm.update()                   # the update point: waiting joiners come in here
        grads = compute()
        comm.allreduce_with_retry(grads, "avg", out=grads)

`rank` and `world_size` are those of the current view and change between epochs. Every
collective has one outcome on every member: it completed everywhere, or it raised `PeerLost`
everywhere with the buffer as it was (retry it; `allreduce_with_retry` does). The protocol is in
docs/elastic.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence

from . import _core
from ._core import InvalidArgumentError, PeerLost
from ._shared_state import ROUND_BYTES, SharedState
from ._shared_state import sync as _sync_shared_state
from .comm import Communicator, _str, _timeout

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["join", "witness", "ElasticCommunicator", "PeerLost", "SharedState"]


def witness(listen: str, *, group: str = "default", heartbeat_timeout: Optional[float] = None) -> Any:
    """Starts a witness for `group` in this process (what `plait witness` runs): it listens on
    `listen` and votes in every view change of the group that names it. Returns an object with
    `contact` and `close()`."""
    kw = {}
    if heartbeat_timeout is not None:
        kw["heartbeat_timeout"] = float(heartbeat_timeout)
    return _core.Witness(listen=_str(listen, "plait.elastic.witness", "listen"), group=_str(group, "plait.elastic.witness", "group"), **kw)


def join(peers: Optional[Sequence[str]] = None, *, listen: Optional[str] = None, group: str = "default",
         timeout: Optional[float] = None, heartbeat_timeout: Optional[float] = None,
         witness: Optional[str] = None, store: Any = None) -> "ElasticCommunicator":
    """Joins the group of a member at one of `peers` ("host:port", its `contact`), or founds a
    new group when `peers` is empty. Returns once a view with this member is agreed: a joiner
    is admitted at the members' next `update()`.

    `peers` defaults to PLAIT_JOIN (comma-separated), so one script serves every machine.
    `listen`: where this member's control plane listens ("host:port", port 0 picks one; default
    PLAIT_LISTEN, else "0.0.0.0:0").
    `timeout`: the deadline of joining, of each operation and of each view change (default
    PLAIT_TIMEOUT). `heartbeat_timeout`: how long a silent member is waited for (default
    PLAIT_HEARTBEAT_TIMEOUT, 2 s). The group's secret is PLAIT_TOKEN, as in static mode.
    `witness`: for the founder, the address of the group's witness (`plait witness`; default
    PLAIT_WITNESS): it votes in every change, so that a group of two survives losing one. Joiners
    learn it from the group.
    `store`: instead of `peers`, a store that keeps the group's addresses ("host:port" of a torch
    TCPStore server such as `plait store`, or a c10d Store object; default PLAIT_JOIN_STORE). The
    first process to find no group there founds one, the others join it, so every machine runs
    the same command. The store is only a directory: the group trains on without it.
    """
    w = "plait.elastic.join"
    if peers is not None and store is not None:
        raise InvalidArgumentError(f"{w}: give peers or a store, not both")
    if peers is None and store is None:
        store = _core.setting("PLAIT_JOIN_STORE") or None
        peers = [p.strip() for p in (_core.setting("PLAIT_JOIN") or "").split(",") if p.strip()]
        if store is not None and peers:
            raise InvalidArgumentError(f"{w}: PLAIT_JOIN and PLAIT_JOIN_STORE are both set; set one")
    if listen is None:
        listen = _core.setting("PLAIT_LISTEN") or "0.0.0.0:0"
    if witness is None:
        witness = _core.setting("PLAIT_WITNESS")
    if isinstance(peers, str):
        peers = [peers]
    peers = [_str(p, w, "peers") for p in (peers or [])]
    kw = {}
    if timeout is not None:
        kw["timeout"] = _timeout(timeout, w)
    if heartbeat_timeout is not None:
        kw["heartbeat_timeout"] = float(heartbeat_timeout)
    if witness is not None:
        kw["witness"] = _str(witness, w, "witness")
    listen, group = _str(listen, w, "listen"), _str(group, w, "group")
    if store is None:
        return ElasticCommunicator(_core.Elastic(peers=peers, listen=listen, group=group, **kw))
    from ._directory import Directory

    period = float(heartbeat_timeout if heartbeat_timeout is not None else _core.setting("PLAIT_HEARTBEAT_TIMEOUT") or 2.0)
    directory = Directory(store, group, period)

    def make(peers, dial_timeout):
        extra = {} if dial_timeout is None else {"dial_timeout": dial_timeout}
        return _core.Elastic(peers=peers, listen=listen, group=group, **kw, **extra)

    core = directory.join(make, float(timeout if timeout is not None else _core.setting("PLAIT_TIMEOUT") or 300.0))
    comm = ElasticCommunicator(core)
    comm._directory = directory
    directory.publish_while(comm)
    return comm


class ElasticCommunicator(Communicator):
    """A member of an elastic group. It has the collectives of `plait.Communicator` (blocking
    only); point-to-point calls and subgroups are not offered in elastic mode."""

    def __init__(self, core: Any) -> None:  # built by join()
        self._store = None
        self._pending = []
        self._comm = core
        self._directory = None

    @property
    def epoch(self) -> int:
        """The current view's number; it grows by one at every view change."""
        return self._comm.epoch

    @property
    def members(self) -> List[str]:
        """The current view's members (ids), most senior first; `rank` is this member's index."""
        return self._comm.members

    @property
    def member_id(self) -> str:
        return self._comm.member_id

    @property
    def contact(self) -> str:
        """The address to give a joiner ("host:port")."""
        return self._comm.contact

    @property
    def group(self) -> str:
        return "elastic"

    @property
    def threads(self) -> str:
        return "creator"

    def __repr__(self):
        return f"<plait.elastic member {self.member_id}: rank {self.rank} of {self.world_size}, epoch {self.epoch}>"

    def update(self) -> bool:
        """The update point: every member calls it at the same place in its loop. Joiners that
        wait are admitted here (all members wait for the new view); True if the view changed.
        A joiner's first call returns True at once: the members are finishing the update point
        that admitted it."""
        return self._comm.update()

    def pending(self) -> int:
        """Joiners this member knows to be waiting (a local answer, no communication)."""
        return self._comm.pending()

    def allreduce_with_retry(self, x: "ArrayLike", op: str = "sum", *, attempts: Optional[int] = None,
                             **kw: Any):
        """`allreduce`, retried over the new view each time it raises PeerLost (the buffer is
        restored each time, and "avg" divides by the members that took part). `attempts`:
        give up (raise the last PeerLost) after this many; default: never."""
        tries = 0
        while True:
            try:
                return self.allreduce(x, op, **kw)
            except PeerLost:
                tries += 1
                if attempts is not None and tries >= attempts:
                    raise

    def should_commit(self, ok: bool = True) -> bool:
        """The per-step commit (torchft's): every member says whether its step went well; True on
        every member if all did and no member was lost, False on every member otherwise (then
        discard the step: restore or skip the optimizer update)."""
        import numpy as np

        flags = np.array([1 if ok else 0], np.int64)
        try:
            self.allreduce(flags, "min", out=flags)
        except PeerLost:
            return False
        return bool(flags[0] == 1)

    def sync_shared_state(self, state: SharedState, *, round_bytes: int = ROUND_BYTES) -> dict:
        """Makes `state` (a `SharedState`: named arrays used in place) bit-identical on every
        member; a collective every member calls at the same point (after `update()` returned
        True, or every step: when nothing differs it costs one small allgather). The state most
        members that synced before hold wins (a tie: the most senior one's; at a group's first
        sync, the most senior member's); joiners never vote. Whoever lacks a chunk of it fetches
        the chunk from the members that hold it, striped over all of them, hash-checked on
        arrival. A member lost meanwhile: the sync goes on over the new view, without fetching
        again what already arrived. Returns what this member did (`fetched_bytes`, `sources`,
        `winner`, `attempts`, `seconds`...). `round_bytes`: the most any member receives per
        transfer round (its staging memory)."""
        return _sync_shared_state(self, state, round_bytes=round_bytes)

    def barrier(self, *, timeout: Optional[float] = None, async_op: bool = False) -> None:
        import numpy as np

        self.allreduce(np.zeros(1, np.uint8), "max", timeout=timeout, async_op=async_op)

    def _not_elastic(self, what):
        raise InvalidArgumentError(f"{what} is not offered in elastic mode: every member's calls must pair up across view changes")

    def send(self, *a, **k):
        self._not_elastic("send")

    def recv(self, *a, **k):
        self._not_elastic("recv")

    def subgroup(self, *a, **k):
        self._not_elastic("subgroup")

    def routes(self):
        return []

    def topology(self) -> str:
        return "elastic"

    def algorithm_for(self, coll: str, nbytes: int, root: int = 0) -> str:
        self._not_elastic("algorithm_for")

    def abort(self, reason: str = "abort() called") -> None:
        self.close()

    def close(self) -> None:
        """Leaves the group: the others go on without this member after their next view change."""
        if self._directory is not None:
            self._directory.stop()
        self._comm.close()
