"""Elastic mode's directory: the group's control addresses kept in a store, so that every machine
can start with the same command and only the store's address (`plait.elastic.join(store=...)`,
PLAIT_JOIN_STORE).

The store is a directory, never a master: members do not use it to agree on anything, and a group
whose store dies trains on; only processes that join through it cannot find the group until it
is back. Any object with torch's c10d Store calls serves (`get`, `set`, `check`, `compare_set`:
torch's TCPStore, FileStore, PrefixStore); a "host:port" string opens a TCPStore client (torch).

The record (JSON under `plait/elastic/<group>/contacts`) lists the members' control addresses,
most senior first. The most senior member rewrites it every `period` seconds (its `beat` counts
up), so a record that stops moving belongs to a group that is gone. Who founds a group is decided
by the store's compare-and-set: of two processes that find no record, one founds and the other
joins it. A joiner clears a record only when none of its addresses answered for two periods and
the record did not move meanwhile: a group that lives but is out of this joiner's reach keeps it.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

from ._core import RendezvousError

# How long a store call may take: the store serves joiners only, never the training loop.
_STORE_TIMEOUT = timedelta(seconds=10)


def open_store(store: Any) -> Any:
    """`store` itself, or a TCPStore client for a "host:port" string."""
    if not isinstance(store, str):
        return store
    host, _, port = store.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"plait.elastic.join: store must be 'host:port' or a store object, got {store!r}")
    from ._store import tcp_store

    return tcp_store(host.strip("[]"), int(port), is_master=False, timeout=_STORE_TIMEOUT, wait_for_workers=False)


class Directory:
    def __init__(self, store: Any, group: str, period: float) -> None:
        self.store = store
        self.key = f"plait/elastic/{group}/contacts"
        self.period = period
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def read(self) -> Tuple[Optional[dict], str]:
        """The record (None when there is none or it was cleared) and its raw text."""
        if not self.store.check([self.key]):
            return None, ""
        raw = _text(self.store.get(self.key))
        if not raw:
            return None, ""
        try:
            rec = json.loads(raw)
        except ValueError:
            return None, raw
        return (rec if isinstance(rec, dict) and rec.get("contacts") else None), raw

    def replace(self, expected: str, desired: str) -> bool:
        """Sets the record to `desired` if it is still `expected` ("" also when there is none)."""
        return _text(self.store.compare_set(self.key, expected, desired)) == desired

    def record(self, contacts: List[str], epoch: int, beat: int) -> str:
        return json.dumps({"contacts": contacts, "epoch": epoch, "beat": beat, "period": self.period})

    def join(self, make: Callable[..., Any], timeout: float) -> Any:
        """Founds the group if the store names none, else joins the one it names; returns the
        member (`make(peers, dial_timeout)` builds one)."""
        end = time.monotonic() + timeout
        tried: List[str] = []
        why: Any = "the record kept changing hands"
        while True:
            if time.monotonic() >= end:
                raise RendezvousError(f"no group found or founded through the store's {self.key} within {timeout:g} s "
                                      f"(last tried: {', '.join(tried) or 'nothing'}): {why}")
            rec, raw = self.read()
            if rec is None:
                member = make([], None)
                if self.replace(raw, self.record([member.contact], member.epoch, 0)):
                    return member
                member.close()  # another process founded first: join that one
                continue
            contacts = [str(c) for c in rec["contacts"]]
            window = 2 * float(rec.get("period") or self.period)
            try:
                return make(contacts, min(window, max(end - time.monotonic(), 0.001)))
            except RendezvousError as e:
                tried, why = contacts, e
            _, raw_now = self.read()
            if raw_now == raw:
                self.replace(raw, "")  # gone: the next one to look founds anew

    def publish_while(self, member: Any) -> None:
        """Keeps the record current from a background thread: written while `member` is the most
        senior member of its view, every period."""

        def run():
            beat = 0
            while not self._stop.wait(self.period):
                try:
                    if member.rank == 0:
                        beat += 1
                        self.store.set(self.key, self.record(list(member.contacts), member.epoch, beat))
                except Exception:  # a store that is down only stops joiners; it is retried
                    continue

        self._thread = threading.Thread(target=run, name="plait-directory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
