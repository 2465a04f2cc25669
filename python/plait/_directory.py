"""Elastic mode's directory: the group's control addresses kept in a store, so that every machine
can start with the same command and only the store's address (`plait.elastic.join(store=...)`,
PLAIT_JOIN_STORE).

The store is a directory, never a master: members do not use it to agree on anything, and a group
whose store dies trains on; only processes that join through it cannot find the group until it
is back. Any object with torch's c10d Store calls serves (`get`, `check`, `compare_set`: torch's
TCPStore, FileStore, PrefixStore); a "host:port" string opens a TCPStore client (torch).

The record (JSON under `plait/elastic/<group>/contacts`) lists the members' control addresses,
most senior first, and their ids. The most senior member rewrites it every `period` seconds (its
`beat` counts up), so a record that stops moving belongs to a group that is gone. Every write is
a compare-and-set from the value last read:

- founding: a process that finds nothing claims the record first (a placeholder naming it) and
  only then founds, so of processes started at once exactly one founds, and no other ever starts
  a group (or talks to the group's witness);
- a claim or record that does not move for two periods while none of its addresses answers is
  cleared, and the next process to look founds anew; a group that lives but is out of this
  process's reach keeps moving its record, so it keeps it;
- the senior member writes over its own group's record (its members overlap) and never over
  another's: if the store was emptied and another group founded meanwhile, the old group stops
  publishing instead of fighting over the key (both groups go on; newcomers find the new one).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

from ._core import ConfigError, RendezvousError

# How long a store call may take: the store serves joiners only, never the training loop.
_STORE_TIMEOUT = timedelta(seconds=10)

log = logging.getLogger("plait.elastic")


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
        # A store given by address is opened again when its connection breaks (a restarted
        # server, a dropped connection); a store object is the caller's to mend.
        self._address = store if isinstance(store, str) else None
        self.store = open_store(store)
        self.key = f"plait/elastic/{group}/contacts"
        self.period = period
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # Every member this process has seen in its group: a record naming any of them is its
        # group's, however long ago it was written (its writer may have died since).
        self._known: set = set()

    def read(self) -> Tuple[Optional[dict], str]:
        """The record with contacts (None for none, a claim or an unreadable one) and the raw text
        ("" when there is nothing)."""
        if not self.store.check([self.key]):
            return None, ""
        raw = _text(self.store.get(self.key))
        try:
            rec = json.loads(raw) if raw else None
        except ValueError:
            return None, raw
        return (rec if isinstance(rec, dict) and rec.get("contacts") else None), raw

    def replace(self, expected: str, desired: str) -> bool:
        """Sets the record to `desired` if it is still `expected` ("" also when there is none)."""
        return _text(self.store.compare_set(self.key, expected, desired)) == desired

    def record(self, member: Any, beat: int) -> str:
        return json.dumps({"contacts": list(member.contacts), "members": list(member.members), "epoch": member.epoch,
                           "beat": beat, "period": self.period})

    def _stale(self, raw: str, since: float, window: float) -> bool:
        """Whether `raw` (read at `since`) stayed as it was for `window`: waits out what is left."""
        time.sleep(max(0.0, since + window - time.monotonic()))
        return self.read()[1] == raw

    def join(self, make: Callable[..., Any], timeout: float) -> Any:
        """Founds the group if the store names none, else joins the one it names; returns the
        member (`make(peers, dial_timeout)` builds one)."""
        end = time.monotonic() + timeout
        tried: List[str] = []
        why: Any = "the record kept changing"
        while True:
            if time.monotonic() >= end:
                raise RendezvousError(f"no group found or founded through the store's {self.key} within {timeout:g} s "
                                      f"(last tried: {', '.join(tried) or 'nothing'}): {why}")
            rec, raw = self.read()
            seen = time.monotonic()
            if not raw:
                claim = json.dumps({"claim": secrets.token_hex(8), "period": self.period})
                if not self.replace("", claim):
                    continue  # another process claimed it first: join what it founds
                try:
                    member = make([], None)
                except BaseException:
                    self.replace(claim, "")
                    raise
                self._known.update(member.members)
                if not self.replace(claim, self.record(member, 0)):
                    log.warning("plait elastic: this group's claim on %s was cleared while it was founded; "
                                "joiners through the store will not find it", self.key)
                return member
            window = 2 * float((rec or _loads(raw)).get("period") or self.period)
            if rec is None:
                # Another process is founding: its record comes once it has; a claim that never
                # turns into one belongs to a process that died meanwhile.
                if seen + window > end:
                    time.sleep(max(0.0, min(self.period / 4, end - time.monotonic())))
                elif self._stale(raw, seen, window):
                    self.replace(raw, "")
                continue
            contacts = [str(c) for c in rec["contacts"]]
            try:
                member = make(contacts, min(window, max(end - seen, 0.001)))
                self._known.update(rec.get("members") or ())
                self._known.update(member.members)
                return member
            except (RendezvousError, ConfigError) as e:  # nobody answered, or someone else now has the address
                tried, why = contacts, e
            if seen + window <= end and self._stale(raw, seen, window):
                self.replace(raw, "")  # gone: the next one to look founds anew

    def publish_while(self, comm: Any) -> None:
        """Keeps the record current from a background thread while `comm` (an
        ElasticCommunicator, held weakly) is the most senior member of its view."""
        ref = weakref.ref(comm)

        def run():
            beat, warned, failed = 0, False, False
            while not self._stop.wait(self.period):
                c = ref()
                if c is None:
                    return
                member = c._comm
                del c
                try:
                    self._known.update(member.members)
                    if member.rank != 0:
                        continue
                    rec, raw = self.read()
                    ours = rec is not None and set(rec.get("members") or ()) & self._known
                    if raw and not ours:
                        if not warned:
                            warned = True
                            log.warning("plait elastic: the store's %s names another group; this group no longer "
                                        "publishes its addresses there", self.key)
                        continue
                    beat += 1
                    self.replace(raw, self.record(member, beat))
                except Exception as e:  # a store that is down only stops joiners; it is retried
                    if self._address is not None:
                        try:
                            self.store = open_store(self._address)
                        except Exception:
                            pass
                    if not failed:
                        failed = True
                        log.warning("plait elastic: cannot publish this group's addresses to the store (%s); "
                                    "retrying every %g s", e, self.period)
                    continue
                failed = False

        self._thread = threading.Thread(target=run, name="plait-directory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=_STORE_TIMEOUT.total_seconds() + self.period)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def _loads(raw: str) -> dict:
    try:
        rec = json.loads(raw)
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}
