"""Start-up under trouble: one deadline across store, accept and handshake; half-open connections
that never send a hello; a store that stops answering; ranks that disagree on the world size or
meet in different stores. Ranks run on threads of this process (the core releases the GIL)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import plait
from kvstore import KVClient, KVServer

HERE = Path(__file__).resolve().parent


def _start(store_of, ranks, n_of, timeout, out=None, **kw):
    """Starts each rank's communicator on a thread; returns ({rank: [comm or exception, seconds]},
    filled as they finish (or `out`), {rank: thread})."""
    out = {} if out is None else out

    def build(r):
        t0 = time.monotonic()
        try:
            c = plait.Communicator(store_of(r), r, n_of(r), timeout=timeout, **kw)
        except Exception as e:  # judged by the test
            c = e
        out[r] = [c, time.monotonic() - t0]

    threads = {r: threading.Thread(target=build, args=(r,), daemon=True) for r in ranks}
    for t in threads.values():
        t.start()
    return out, threads


def _join(threads, limit):
    deadline = time.monotonic() + limit
    for t in threads.values():
        t.join(max(0.0, deadline - time.monotonic()))
    return [r for r, t in threads.items() if t.is_alive()]


def _close(results):
    for c, _ in results.values():
        if isinstance(c, plait.Communicator):
            c.close()


def _port_of(store, rank):
    """The listening port rank `rank` published (the record plait keeps in the store)."""
    store.wait([f"plait/default/0/rank/{rank}"], 20)
    return json.loads(store.get(f"plait/default/0/rank/{rank}"))["port"]


@pytest.mark.parametrize("silent", [64, 200])
def test_half_open_connections_do_not_block_startup(silent):
    """`silent` connections that never send a hello sit on rank 0's listener while the real peers
    start, with a start-up deadline shorter than the hello deadline: the peers still get in."""
    n, store = 3, KVServer()
    # The allreduce below runs on other threads than the ones that made the communicators.
    results, threads = _start(lambda r: store, [0], lambda r: n, timeout=4, threads="sequential")
    port = _port_of(store, 0)
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(silent)]
    try:
        time.sleep(0.3)  # all of them accepted before the peers come
        threads.update(_start(lambda r: store, [1, 2], lambda r: n, timeout=4, out=results, threads="sequential")[1])
        assert not _join(threads, 15), "start-up hung"
        failed = {r: c for r, (c, _) in results.items() if isinstance(c, Exception)}
        assert not failed, failed
        y = [None] * n

        def run(r):
            y[r] = results[r][0].allreduce(np.full(4, r + 1, np.float32))

        ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        assert all(v is not None and v.tolist() == [6.0] * 4 for v in y), y
    finally:
        for s in held:
            s.close()
        _close(results)


def test_startup_timeout_names_half_open_connections():
    """A peer that never comes, with silent connections open: the timeout names them."""
    store = KVServer()
    results, threads = _start(lambda r: store, [0], lambda r: 2, timeout=2)
    port = _port_of(store, 0)
    # Publishes rank 1's record, so rank 0 waits in accept, not in the store.
    store.set("plait/default/0/rank/1", json.dumps(
        {"rank": 1, "port": 1, "host": "", "machine": None, "addrs": [], "world": 2, "key": "11" * 32}).encode())
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
    try:
        assert not _join(threads, 10)
        err = results[0][0]
        assert isinstance(err, plait.PlaitError), err
        msg = str(err)
        assert "rank 1" in msg and "sent no hello" in msg, msg
        assert f"127.0.0.1:{held[0].getsockname()[1]}" in msg, msg
    finally:
        for s in held:
            s.close()
        _close(results)


def _store_server(kind):
    """A store server in a process of its own (so that it can be stopped) and a client maker."""
    if kind == "kv":
        code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from kvstore import KVServer; s = KVServer(); "
                "print(s.port, flush=True); time.sleep(600)")
    else:
        code = ("import datetime, sys, time; sys.path.insert(0, sys.argv[1]); from plait._store import tcp_store; "
                "s = tcp_store('127.0.0.1', 0, None, True, timeout=datetime.timedelta(seconds=60), "
                "wait_for_workers=False); print(s.port, flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", code, str(HERE) if kind == "kv" else str(HERE.parent / "python")],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    port = int(p.stdout.readline())
    if kind == "kv":
        return p, lambda: KVClient(port)
    import datetime

    from plait._store import tcp_store
    return p, lambda: tcp_store("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))


@pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP")
@pytest.mark.parametrize("kind", ["kv", "torch"])
def test_a_store_that_stops_answering_fails_startup_within_its_deadline(kind):
    """The store server stops (SIGSTOP) while ranks wait in it: start-up fails by its deadline,
    naming the store and the wait, instead of hanging in the store client (torch's TCPStore
    client waits for good)."""
    if kind == "torch":
        pytest.importorskip("torch.distributed")
    server, client = _store_server(kind)
    timeout = 4.0
    try:
        # Rank 2 never comes, so ranks 0 and 1 are waiting in the store when it stops.
        stores = {r: client() for r in (0, 1)}
        results, threads = _start(lambda r: stores[r], [0, 1], lambda r: 3, timeout=timeout)
        time.sleep(1.0)
        os.kill(server.pid, signal.SIGSTOP)
        hung = _join(threads, timeout + 10)
        assert not hung, f"ranks {hung} still waiting in the stopped store"
        for r, (err, took) in results.items():
            assert isinstance(err, plait.PlaitError), (r, err)
            assert took < timeout + 1.5, f"rank {r} gave up after {took:.1f} s, deadline {timeout} s"
            msg = str(err)
            assert "store" in msg and "wait" in msg and "did not answer" in msg, msg
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)


def test_world_size_mismatch_is_named_by_every_rank_at_once():
    """Rank 1 was started with world size 2, ranks 0 and 2 with 3: all three say so, at once."""
    store = KVServer()
    results, threads = _start(lambda r: store, [0, 1, 2], lambda r: 2 if r == 1 else 3, timeout=10)
    assert not _join(threads, 20)
    try:
        for r, (err, took) in results.items():
            assert isinstance(err, plait.PlaitError), (r, err)
            assert "world size" in str(err), (r, str(err))
            assert took < 5, f"rank {r} took {took:.1f} s to say: {err}"
        assert "rank 1 has world size 2, this rank (0) 3" in str(results[0][0]), str(results[0][0])
        assert "rank 0 has world size 3, this rank (1) 2" in str(results[1][0]), str(results[1][0])
    finally:
        _close(results)


@pytest.mark.parametrize("how", ["store", "group"])
def test_ranks_in_different_stores_or_groups_are_told_so(how):
    """Ranks 0 and 1 meet in one store (or group), rank 2 in another: every rank's error says
    that the missing ranks are elsewhere, not just that a key did not appear."""
    a, b = KVServer(), KVServer()
    if how == "store":
        results, threads = _start(lambda r: b if r == 2 else a, [0, 1, 2], lambda r: 3, timeout=3)
    else:
        results, threads = {}, {}
        for r in range(3):
            threads.update(_start(lambda r: a, [r], lambda r: 3, timeout=3, out=results,
                                  group="other" if r == 2 else "default")[1])
    assert not _join(threads, 15)
    try:
        msgs = {r: str(c) for r, (c, _) in results.items()}
        assert all(isinstance(c, plait.PlaitError) for c, _ in results.values()), msgs
        assert "no other rank published" in msgs[2] and "same store" in msgs[2], msgs[2]
        for r in (0, 1):
            assert "rank 2 did not publish" in msgs[r] and "another store" in msgs[r], msgs[r]
    finally:
        _close(results)
