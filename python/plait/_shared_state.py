"""Shared state (elastic mode): named arrays kept bit-identical on every member.

`sync(comm, state)` is a collective every member calls at the same point of its loop (after an
`update()` that admitted joiners, or every step: it costs one small allgather when nothing
differs). Each member hashes its state in fixed chunks (BLAKE3, `_core.chunk_hashes`):

1. An allgather of each member's header: the layout's hash (names, dtypes, shapes, chunk size),
   the state's hash (of its chunk hashes) and whether it votes (it has been synced before).
2. The winning state is the one most voters hold; a tie goes to the state of the most senior
   voter. With no voter (a group's first sync), the most senior member's state wins. A joiner
   never votes, so a crowd of joiners cannot outvote the members.
3. If some member's state differs: an allgather of every member's chunk hashes, then each member
   that lacks a chunk of the winning state fetches it from a member that holds it; a receiver's
   chunks are dealt out over all the holders of each, so a joiner downloads from every member at
   once. The transfers run as alltoall_v rounds of at most `round_bytes` per receiver; each
   chunk's hash is checked on arrival before it is written in place.
4. A last allreduce says whether every chunk arrived intact, on every member alike.

A member lost meanwhile fails the current collective on every member (`PeerLost`), and the sync
starts again over the new view: chunks already written match the winner and are not fetched
again, so a download continues from the holders that remain.
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import _core
from ._core import InvalidArgumentError, PeerError, PeerLost

HASH = 32
CHUNK_BYTES = 4 << 20
ROUND_BYTES = 64 << 20
_HEADER = 2 * HASH + 1


def _byte_view(x: Any, name: str) -> Tuple[np.ndarray, Tuple[str, List[int]]]:
    """The bytes of `x` (a CPU torch tensor or a numpy array, used in place) and its (dtype, shape)."""
    w = "SharedState"
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise InvalidArgumentError(f"{w}: {name!r} is on {x.device}; shared state is held in CPU memory")
        if not x.is_contiguous():
            raise InvalidArgumentError(f"{w}: {name!r} is not contiguous")
        import torch

        t = x.detach()
        return t.reshape(-1).view(torch.uint8).numpy(), (str(t.dtype), list(t.shape))
    if not isinstance(x, np.ndarray):
        raise InvalidArgumentError(f"{w}: {name!r} is a {type(x).__name__}; give numpy arrays or CPU torch tensors (used in place)")
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise InvalidArgumentError(f"{w}: {name!r} must be C-contiguous and writable")
    return x.reshape(-1).view(np.uint8), (x.dtype.str, list(x.shape))


def _hash(data: np.ndarray) -> bytes:
    return _core.chunk_hashes(data.ctypes.data, data.nbytes, max(data.nbytes, 1)) if data.nbytes else b"\0" * HASH


class SharedState:
    """Named arrays (numpy arrays or CPU torch tensors, used in place) that `sync_shared_state`
    keeps bit-identical on every member. `chunk_bytes`: the unit that is hashed, compared and
    fetched (default 4 MiB); every member must use the same."""

    def __init__(self, arrays: Mapping[str, Any], *, chunk_bytes: int = CHUNK_BYTES) -> None:
        if int(chunk_bytes) <= 0:
            raise InvalidArgumentError(f"SharedState: chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = int(chunk_bytes)
        self.names: List[str] = sorted(arrays)
        views = [_byte_view(arrays[n], n) for n in self.names]
        self._bytes: List[np.ndarray] = [v for v, _ in views]
        layout = [[n, dt, shape, b.nbytes] for n, (b, (dt, shape)) in zip(self.names, views)]
        text = json.dumps({"chunk": self.chunk_bytes, "entries": layout}, sort_keys=True).encode()
        self.layout_hash = _hash(np.frombuffer(text, np.uint8))
        # chunk k of the state: (entry, start, stop) in that entry's bytes
        self.chunks: List[Tuple[int, int, int]] = [
            (e, s, min(s + self.chunk_bytes, b.nbytes)) for e, b in enumerate(self._bytes) for s in range(0, b.nbytes, self.chunk_bytes)]
        self.synced = False  # a member votes once its state has been synced

    def chunk(self, k: int) -> np.ndarray:
        e, s, t = self.chunks[k]
        return self._bytes[e][s:t]

    def chunk_hashes(self) -> bytes:
        return b"".join(_core.chunk_hashes(b.ctypes.data, b.nbytes, self.chunk_bytes) for b in self._bytes)

    def digest(self) -> str:
        """The state's hash (BLAKE3 of its chunk hashes), in hex: equal on two members exactly
        when their states are bit-identical (with one layout)."""
        return _hash(np.frombuffer(self.chunk_hashes(), np.uint8)).hex()


def winner(headers: Sequence[Tuple[bytes, bytes, bool]]) -> int:
    """The rank whose state wins, from every member's (layout hash, state hash, votes): the state
    most voters hold; a tie goes to the most senior voter's; no voter: rank 0's."""
    voters = [r for r, h in enumerate(headers) if h[2]] or [0]
    count: Dict[bytes, int] = {}
    for r in voters:
        count[headers[r][1]] = count.get(headers[r][1], 0) + 1
    best = max(count.values())
    return next(r for r in voters if count[headers[r][1]] == best)


def plan(table: Sequence[Sequence[bytes]], win: int, sizes: Sequence[int], round_bytes: int) -> List[List[Tuple[int, int, int]]]:
    """The transfers that give every member the winner's chunks: rounds of (chunk, source,
    destination). `table[m][k]`: member m's hash of chunk k; `sizes[k]`: chunk k's bytes. A
    chunk goes from its least loaded holder (ties: the holders in turn, from a different one per
    receiver), so a download is striped over every member that holds the content; a round gives
    no receiver more than `round_bytes` (or one chunk)."""
    n = len(table)
    transfers = []
    dealt = [0] * n  # chunks dealt to each receiver so far
    sent = [0] * n  # bytes each holder is to send
    for k in range(len(sizes)):
        want = table[win][k]
        holders = [m for m in range(n) if table[m][k] == want]
        for m in range(n):
            if table[m][k] != want:
                turn = (dealt[m] + m) % len(holders)
                src = min(holders[turn:] + holders[:turn], key=lambda h: sent[h])  # the least loaded, in turn
                transfers.append((k, src, m))
                dealt[m] += 1
                sent[src] += sizes[k]
    rounds: List[List[Tuple[int, int, int]]] = []
    load = [0] * n
    for k, src, dst in transfers:
        if not rounds or (load[dst] and load[dst] + sizes[k] > round_bytes):
            rounds.append([])
            load = [0] * n
        rounds[-1].append((k, src, dst))
        load[dst] += sizes[k]
    return rounds


def sync(comm: Any, state: SharedState, *, round_bytes: int = ROUND_BYTES) -> Dict[str, Any]:
    """Makes `state` bit-identical on every member of `comm` (an ElasticCommunicator); see the
    module's docstring. Returns what this member did: `fetched_bytes`, `fetched_chunks`,
    `sources` (member id: bytes fetched from it), `sent_bytes`, `winner` (member id),
    `attempts`, `seconds`."""
    start = time.perf_counter()
    report: Dict[str, Any] = {"fetched_bytes": 0, "fetched_chunks": 0, "sources": {}, "sent_bytes": 0, "winner": None, "attempts": 0}
    while True:
        report["attempts"] += 1
        try:
            _sync_once(comm, state, round_bytes, report)  # what arrived before a PeerLost stays written and counted
        except PeerLost:
            continue
        report["seconds"] = time.perf_counter() - start
        state.synced = True
        return report


def _sync_once(comm: Any, state: SharedState, round_bytes: int, report: Dict[str, Any]) -> None:
    hashes = state.chunk_hashes()
    members, me = comm.members, comm.rank  # read before the call: a lost member fails it (PeerLost)
    n = len(members)
    header = np.frombuffer(state.layout_hash + _hash(np.frombuffer(hashes, np.uint8)) + bytes([state.synced]), np.uint8).copy()
    got = comm.allgather(header).reshape(n, _HEADER)
    headers = [(bytes(h[:HASH]), bytes(h[HASH:2 * HASH]), bool(h[2 * HASH])) for h in got]
    win = winner(headers)
    report["winner"] = members[win]
    odd = [members[r] for r, h in enumerate(headers) if h[0] != headers[win][0]]
    if odd:
        raise InvalidArgumentError(f"sync_shared_state: member(s) {', '.join(odd)} hold shared state of another layout (names, dtypes, "
                                   f"shapes or chunk size) than member {members[win]}'s; every member must register the same arrays")
    if all(h[1] == headers[win][1] for h in headers):
        return
    nchunks = len(state.chunks)
    table_bytes = comm.allgather(np.frombuffer(hashes, np.uint8).copy()).reshape(n, nchunks * HASH)
    table = [[bytes(row[k * HASH:(k + 1) * HASH]) for k in range(nchunks)] for row in table_bytes]
    sizes = [t - s for _, s, t in state.chunks]
    bad = 0
    rounds = plan(table, win, sizes, round_bytes)
    # One receive buffer for every round: the largest any round brings this member.
    inbox = np.empty(max((sum(sizes[k] for k, _, dst in r if dst == me) for r in rounds), default=0), np.uint8)
    for rnd in rounds:
        sends = sorted((dst, k) for k, src, dst in rnd if src == me)
        recvs = sorted((src, k) for k, src, dst in rnd if dst == me)
        send_counts, recv_counts = [0] * n, [0] * n
        for dst, k in sends:
            send_counts[dst] += sizes[k]
        for src, k in recvs:
            recv_counts[src] += sizes[k]
        out = inbox[:sum(recv_counts)]
        send = np.concatenate([state.chunk(k) for _, k in sends]) if sends else np.empty(0, np.uint8)
        comm.alltoall_v(send, send_counts, recv_counts, out=out)
        report["sent_bytes"] += send.nbytes
        at = 0
        for src, k in recvs:
            piece = out[at:at + sizes[k]]
            at += sizes[k]
            if _hash(piece) != table[win][k]:
                bad += 1  # kept as it was; every member hears of it below
                continue
            state.chunk(k)[:] = piece
            report["fetched_bytes"] += sizes[k]
            report["fetched_chunks"] += 1
            report["sources"][members[src]] = report["sources"].get(members[src], 0) + sizes[k]
    flags = np.array([bad], np.int64)
    comm.allreduce(flags, "sum", out=flags)
    if flags[0]:
        raise PeerError(f"sync_shared_state: {int(flags[0])} chunk(s) arrived with another hash than their sender announced "
                        "(its state changed during the sync?); they were not written")
