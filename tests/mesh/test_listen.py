"""Who can reach a rank's listener: with PLAIT_IFACE=lo nothing outside the host can, and a
connection from an address that no peer published is closed before a byte of it is read. Two
testbed nodes: rank 0 (and later rank 1) in node 0, a stranger in node 1 on the cable between them."""

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from plait.tools.testbed import Testbed, cable_addr, lan_addr

HERE = Path(__file__).resolve().parent
HELPER = str(HERE / "listen_worker.py")
_names = iter(f"pltestl{i}" for i in range(1000))


class Proc:
    """A helper process in a testbed node whose '@@' lines are read as they come."""

    def __init__(self, tb, node, role, args=None, env=None):
        env = dict(tb.env(node, 0), **(env or {}))
        self.p = tb.popen(node, [sys.executable, HELPER, role, json.dumps(args or {})], env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self.events = [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("@@"):
                self.events.put(json.loads(line[2:]))

    def next(self, timeout=30):
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no event within the time; output:\n" + "\n".join(self.lines[-40:])) from None

    def say(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


def _bed():
    return Testbed(2, name=next(_names), link_rate=None, lan_rate=None)


def test_a_listener_restricted_to_lo_is_not_reachable_from_another_namespace():
    with _bed() as tb:
        ranks = Proc(tb, 0, "ranks", env={"PLAIT_IFACE": "lo"})
        try:
            port = ranks.next()["port"]
            for addr in (cable_addr(0, 1), lan_addr(0)):
                s = Proc(tb, 1, "stranger", {"addr": addr, "port": port, "hello": True, "read_for": 2})
                try:
                    got = s.next()["connect"]
                    assert "ConnectionRefused" in got, f"{addr}:{port} reachable from node 1 with PLAIT_IFACE=lo: {got}"
                finally:
                    s.kill()
            ranks.say("go")
            res = ranks.next(60)
            assert res["ok"], res
        finally:
            ranks.kill()


def test_a_connection_from_an_address_no_peer_published_is_closed_unread():
    """A stranger on node 1 connects before rank 1 and claims to be rank 1: it gets no answer (no
    byte is read from it once rank 0 knows its peers), and the real rank 1 joins."""
    with _bed() as tb:
        ranks = Proc(tb, 0, "ranks")
        stranger = None
        try:
            port = ranks.next()["port"]
            stranger = Proc(tb, 1, "stranger", {"addr": cable_addr(0, 1), "port": port, "hello": True,
                                                "read_for": 20})
            assert stranger.next()["connect"] == "ok"
            time.sleep(0.5)  # its hello is there before rank 1 starts
            t0 = time.monotonic()
            ranks.say("go")
            res = ranks.next(60)
            assert res["ok"], f"the real rank 1 did not get in: {res}"
            seen = stranger.next(30)
            assert seen["read"] == "", f"the stranger was answered: {bytes.fromhex(seen['read'])!r}"
            assert seen["end"] != "still open", seen
            assert time.monotonic() - t0 < 15, "the stranger was not closed when rank 0 learned its peers"
        finally:
            ranks.kill()
            if stranger is not None:
                stranger.kill()
