"""Bad input gets a clear error before anything is sent, and leaves the communicator usable.
In-process: a world of one, and a world of two run on threads (the core releases the GIL)."""

import array
import threading

import numpy as np
import pytest

import plait

torch_dist = pytest.importorskip("torch.distributed")


def _comms(n, store=None, **kw):
    """n communicators in this process (one thread each while they meet). They are used from
    other threads afterwards, one call at a time: threads="sequential"."""
    store = torch_dist.HashStore() if store is None else store
    kw.setdefault("threads", "sequential")
    comms, errors = [None] * n, []

    def build(r):
        try:
            comms[r] = plait.Communicator(store, r, n, timeout=20, **kw)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(comms), "communicators did not form within 30 s"
    return comms


def _on_all(comms, fn, timeout=30):
    """fn(comm) on every rank at once; returns the results."""
    out, errors = [None] * len(comms), []

    def go(r):
        try:
            out[r] = fn(comms[r])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "collective did not finish"
    assert not errors, errors
    return out


@pytest.fixture(scope="module")
def one():
    (c,) = _comms(1)
    yield c
    c.close()


@pytest.fixture(scope="module")
def two():
    comms = _comms(2)
    yield comms
    for c in comms:
        c.close()


F32 = np.arange(8, dtype=np.float32)


# -- errors --------------------------------------------------------------------------------------
def test_exception_hierarchy():
    for name in ("PeerError", "PlaitTimeoutError", "AbortedError", "MismatchError", "BrokenError",
                 "RendezvousError", "ConfigError", "InvalidArgumentError"):
        assert issubclass(getattr(plait, name), plait.PlaitError)
    assert issubclass(plait.PlaitTimeoutError, TimeoutError)
    assert issubclass(plait.InvalidArgumentError, ValueError)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64, np.complex64, np.float128 if hasattr(np, "float128") else np.complex128, ">f4", "<U3", object])
def test_unsupported_dtype(one, dtype):
    x = np.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match="dtype"):
        one.allreduce(x)


def test_non_contiguous(one):
    with pytest.raises(plait.InvalidArgumentError, match="contiguous"):
        one.allreduce(np.arange(16, dtype=np.float32)[::2])
    with pytest.raises(plait.InvalidArgumentError, match="contiguous"):
        one.allreduce(F32, out=np.zeros(16, np.float32)[::2])
    with pytest.raises(plait.InvalidArgumentError, match="contiguous"):
        one.allgather(np.zeros((4, 4), np.float32).T)


def test_read_only_output(one):
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(plait.InvalidArgumentError, match="read-only"):
        one.allreduce(F32, out=ro)
    with pytest.raises(plait.InvalidArgumentError, match="read-only"):
        one.broadcast(ro, 0)
    with pytest.raises(plait.InvalidArgumentError, match="read-only"):
        one.broadcast(bytes(8), 0)
    with pytest.raises(plait.InvalidArgumentError, match="buffer"):
        one.allreduce(F32, out=[0.0] * 8)


def test_output_size_and_dtype(one):
    with pytest.raises(plait.InvalidArgumentError, match="too small"):
        one.allreduce(F32, out=np.zeros(7, np.float32))
    with pytest.raises(plait.InvalidArgumentError, match="too large"):
        one.allreduce(F32, out=np.zeros(9, np.float32))
    with pytest.raises(plait.InvalidArgumentError, match="dtype"):
        one.allreduce(F32, out=np.zeros(8, np.float64))
    with pytest.raises(plait.InvalidArgumentError, match="elements"):
        one.allgather(F32, out=np.zeros(4, np.float32))
    with pytest.raises(plait.InvalidArgumentError, match="elements"):
        one.scatter(np.zeros(3, np.float32), 0, np.zeros(4, np.float32))


def test_ranks_out_of_range(one):
    for bad in (1, -1, 5):
        with pytest.raises(plait.InvalidArgumentError, match="out of range"):
            one.reduce(F32, bad)
        with pytest.raises(plait.InvalidArgumentError, match="out of range"):
            one.broadcast(F32.copy(), bad)
        with pytest.raises(plait.InvalidArgumentError, match="out of range"):
            one.gather(F32, bad)
        with pytest.raises(plait.InvalidArgumentError, match="out of range"):
            one.scatter(F32, bad, np.zeros(8, np.float32))
        with pytest.raises(plait.InvalidArgumentError, match="out of range"):
            one.send(F32, bad)
        with pytest.raises(plait.InvalidArgumentError, match="out of range"):
            one.recv(F32.copy(), bad)
    with pytest.raises(plait.InvalidArgumentError, match="this rank"):
        one.send(F32, 0)
    with pytest.raises(plait.InvalidArgumentError, match="int"):
        one.reduce(F32, 0.5)
    with pytest.raises(plait.InvalidArgumentError, match="out of range"):
        plait.Communicator(torch_dist.HashStore(), 2, 2)


def test_counts(one):
    with pytest.raises(plait.InvalidArgumentError, match="entries"):
        one.allgather_v(F32, [8, 0])
    with pytest.raises(plait.InvalidArgumentError, match="counts"):
        one.allgather_v(F32, [7])
    with pytest.raises(plait.InvalidArgumentError, match="negative"):
        one.reduce_scatter_v(F32, [-1])
    with pytest.raises(plait.InvalidArgumentError, match="sum"):
        one.reduce_scatter_v(F32, [7])
    with pytest.raises(plait.InvalidArgumentError, match="sum"):
        one.alltoall_v(F32, [9], [8])
    with pytest.raises(plait.InvalidArgumentError, match="entries"):
        one.alltoall_v(F32, [8], [4, 4])
    with pytest.raises(plait.InvalidArgumentError, match="counts"):
        one.gather(F32, 0, counts=[3])
    with pytest.raises(plait.InvalidArgumentError, match="ints"):
        one.allgather_v(F32, ["8"])


def test_ops(one):
    with pytest.raises(plait.InvalidArgumentError, match="bitwise"):
        one.allreduce(F32, "bxor")
    with pytest.raises(plait.InvalidArgumentError, match="floating"):
        one.allreduce(np.arange(4), "avg")
    with pytest.raises(plait.InvalidArgumentError, match="floating"):
        one.allreduce(np.ones(4, bool), "premul_sum", factor=2.0)
    with pytest.raises(plait.InvalidArgumentError, match="factor"):
        one.allreduce(F32, "premul_sum")
    with pytest.raises(plait.InvalidArgumentError, match="factor"):
        one.allreduce(F32, "sum", factor=2.0)
    with pytest.raises(plait.InvalidArgumentError, match="unknown op"):
        one.allreduce(F32, "median")
    with pytest.raises(plait.InvalidArgumentError, match="timeout"):
        one.allreduce(F32, timeout=-1)


def test_unknown_algorithm_is_config_error(monkeypatch):
    store = torch_dist.HashStore()
    for spec in ("allreduce:nope", "nope:ring", "allreduce"):
        monkeypatch.setenv("PLAIT_ALGO", spec)
        with pytest.raises(plait.ConfigError, match="nope|allreduce"):
            plait.Communicator(store, 0, 1)
    monkeypatch.delenv("PLAIT_ALGO")
    with pytest.raises(plait.ConfigError):
        plait.Communicator(store, 0, 1, algo="allgather:nope")
    with plait.Communicator(store, 0, 1, epoch=1) as c:
        with pytest.raises((plait.ConfigError, plait.InvalidArgumentError)):
            c.allreduce(F32, algo="nope")


def test_bad_timeout_env_is_config_error(monkeypatch):
    monkeypatch.setenv("PLAIT_TIMEOUT", "soon")
    with pytest.raises(plait.ConfigError, match="PLAIT_TIMEOUT"):
        plait.Communicator(torch_dist.HashStore(), 0, 1)


def test_init_from_env_missing(monkeypatch):
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(plait.ConfigError, match="MASTER_ADDR"):
        plait.init_from_env()


# -- a world of two: errors on one rank send nothing -------------------------------------------------
def test_errors_leave_world_usable(two):
    a, b = two
    bad_calls = [
        lambda: a.allreduce(np.zeros(4, np.uint16)),
        lambda: a.allreduce(F32, out=np.zeros(4, np.float32)),
        lambda: a.reduce_scatter(np.zeros(7, np.float32)),
        lambda: a.alltoall(np.zeros(7, np.float32)),
        lambda: a.allgather_v(F32, [8, 1, 1]),
        lambda: a.allgather_v(F32, [7, 8]),
        lambda: a.scatter(np.zeros(7, np.float32), 0, np.zeros(4, np.float32)),
        lambda: a.broadcast(F32.copy(), 2),
        lambda: a.send(F32, 0),
        lambda: a.allreduce(np.zeros(8, np.int32), "avg"),
    ]
    for call in bad_calls:
        with pytest.raises((plait.InvalidArgumentError, TypeError)):
            call()
    ys = _on_all(two, lambda c: c.allreduce(np.full(8, c.rank + 1, np.float32)))
    assert all(np.all(y == 3) for y in ys)


# -- things that must work -----------------------------------------------------------------------------
def test_buffer_protocol_objects(two):
    def go(c):
        fa = array.array("f", [c.rank + 1.0] * 5)
        y = c.allreduce(fa, out=fa)  # in place on an array.array
        ba = bytearray([c.rank]) * 3
        g = c.allgather(ba)
        mv = memoryview(bytearray(8))
        c.broadcast(mv, 1) if c.rank == 0 else (mv.__setitem__(slice(0, 8), b"abcdefgh"), c.broadcast(mv, 1))
        return list(fa), g.tolist(), bytes(mv), y.dtype

    (fa0, g0, mv0, dt0), _ = _on_all(two, go)
    assert fa0 == [3.0] * 5 and dt0 == np.float32
    assert g0 == [[0, 0, 0], [1, 1, 1]]
    assert mv0 == b"abcdefgh"


def test_async_work_and_result(two):
    def go(c):
        x = np.full(1000, c.rank, np.int64)
        w = c.allreduce(x, async_op=True)
        assert isinstance(w, plait.Work)
        y = w.result(30)
        assert w.is_completed() and w.wait(0.01)
        r = c.gather(np.full(3, c.rank, np.int8), 0, async_op=True).result(30)
        return y, r

    (y0, r0), (y1, r1) = _on_all(two, go)
    assert np.all(y0 == 1) and np.all(y1 == 1)
    assert r0.tolist() == [[0, 0, 0], [1, 1, 1]] and r1 is None


def test_shapes(two):
    def go(c):
        x = np.full((2, 3), c.rank, np.float32)
        return (c.allreduce(x).shape, c.allgather(x).shape, c.reduce_scatter(x).shape,
                c.reduce_scatter(np.zeros(6, np.float32)).shape, c.alltoall(x).shape)

    for shapes in _on_all(two, go):
        assert shapes == ((2, 3), (2, 2, 3), (3,), (3,), (2, 3))


def test_properties_and_routes(two):
    a, b = two
    assert (a.rank, a.world_size, b.rank, b.size) == (0, 2, 1, 2)
    assert a.group == "default" and a.epoch == 0
    routes = a.routes()
    assert [r["peer"] for r in routes] == [1] and {"local", "remote", "reason"} <= set(routes[0])
    assert a.algorithm_for("allreduce", 1 << 20) in plait._core.algorithms("allreduce")
    assert "rank 0/2" in repr(a)
    # On one host the links are not measured, and rings keep the rank order.
    assert a.link_matrix() is None and a.ring_order() == [0, 1] == b.ring_order()
    assert routes[0]["rx_bytes_per_s"] is None
    # The cost model's price: more bytes cost more, and a forced algorithm is the one priced.
    small, chosen = a.predict("allreduce", 1 << 10)
    big, _ = a.predict("allreduce", 64 << 20)
    assert 0 < small < big and chosen == a.algorithm_for("allreduce", 1 << 10)
    assert a.predict("allreduce", 1 << 20, algo="rhd")[1] == "rhd"
    with pytest.raises(plait.ConfigError, match="unknown allreduce algorithm 'nope'"):
        a.predict("allreduce", 8, algo="nope")


def test_prefix_store_and_groups():
    """Two groups meet on one PrefixStore at the same time and stay apart."""
    store = torch_dist.PrefixStore("job7", torch_dist.HashStore())
    built = {}
    threads = [threading.Thread(target=lambda g: built.__setitem__(g, _comms(2, store, group=g)), args=(g,),
                                daemon=True) for g in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(built) == {"a", "b"}
    ya = _on_all(built["a"], lambda c: c.allreduce(np.full(3, 1 + c.rank, np.int32)))
    yb = _on_all(built["b"], lambda c: c.allreduce(np.full(3, 10 * (1 + c.rank), np.int32)))
    assert all(y.tolist() == [3, 3, 3] for y in ya) and all(y.tolist() == [30, 30, 30] for y in yb)
    assert built["b"][0].group == "b"
    for c in built["a"] + built["b"]:
        c.close()


def test_close_is_idempotent_and_breaks():
    (c,) = _comms(1)
    c.close()
    c.close()
    with pytest.raises(plait.BrokenError):
        c.allreduce(F32)


def test_version():
    assert plait.__version__ and plait.__version__ != "0+unknown"
