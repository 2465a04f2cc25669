"""Absurd values for every argument and setting raise a ValueError or TypeError naming the argument
or setting and its range, at once: never PanicException, never a hang. Before, a timeout of 1e19 s
or infinity, PLAIT_TIMEOUT=inf or a world size of 2**32+2 panicked in the core (Duration and Instant
arithmetic) or hung. Python and Rust check through the same validator (the core's)."""

import datetime
import time
import threading

import numpy as np
import pytest

import plait

torch_dist = pytest.importorskip("torch.distributed")

BAD_TIMEOUTS = [1e19, float("inf"), float("-inf"), float("nan"), -1, 0, 1e-9, 10**30, "soon"]
RANGE = "between"  # every refusal says the allowed range: "... between 0.001 and 31536000"


def _raises(call, *names):
    """call() raises ValueError/TypeError mentioning every one of `names`, within 20 s."""
    got = []

    def run():
        try:
            call()
            got.append(None)
        except BaseException as e:  # PanicException is a BaseException: caught to be reported
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert got, "hung"
    err = got[0]
    assert isinstance(err, (ValueError, TypeError)), f"{type(err).__name__}: {err}"
    for n in names:
        assert n in str(err), f"{n!r} not in: {err}"
    return err


def _new(**kw):
    kw.setdefault("timeout", 5)
    args = {k: kw.pop(k) for k in ("rank", "world_size") if k in kw}
    return plait.Communicator(torch_dist.HashStore(), args.get("rank", 0), args.get("world_size", 1), **kw)


@pytest.fixture(scope="module")
def one():
    c = plait.Communicator(torch_dist.HashStore(), 0, 1, timeout=5, threads="sequential")  # calls run on threads
    yield c
    c.close()


# -- arguments of the direct API ---------------------------------------------------------------------
@pytest.mark.parametrize("t", BAD_TIMEOUTS, ids=repr)
def test_communicator_timeout(t):
    _raises(lambda: _new(timeout=t), "timeout", RANGE if not isinstance(t, str) else "")


@pytest.mark.parametrize("call", ["allreduce", "barrier", "send", "recv", "wait", "subgroup"])
@pytest.mark.parametrize("t", [1e19, float("inf"), float("nan"), -5], ids=repr)
def test_call_timeouts(one, call, t):
    x = np.zeros(4, np.float32)
    calls = {
        "allreduce": lambda: one.allreduce(x, timeout=t),
        "barrier": lambda: one.barrier(timeout=t),
        "send": lambda: one.send(x, 0, timeout=t),  # refused for its timeout or its peer: both named
        "recv": lambda: one.recv(x, 0, timeout=t),
        "wait": lambda: one.allreduce(x, async_op=True).wait(t),
        "subgroup": lambda: one.subgroup([0], f"s{call}{t}", timeout=t),
    }
    err = _raises(calls[call])
    assert "timeout" in str(err) or call in ("send", "recv"), err


@pytest.mark.parametrize("n", [2**32 + 2, 2**64, 0, -1, 1.5, "2", 70000], ids=repr)
def test_world_size(n):
    _raises(lambda: _new(world_size=n), "world_size")


@pytest.mark.parametrize("r", [-1, 1, 2**64, "0"], ids=repr)
def test_rank(r):
    _raises(lambda: _new(rank=r), "rank")


@pytest.mark.parametrize("e", [-1, 2**64, 1.5], ids=repr)
def test_epoch(e):
    _raises(lambda: _new(epoch=e), "epoch")


@pytest.mark.parametrize("kw,name", [({"group": 123}, "group"), ({"algo": 5}, "algo"), ({"threads": "many"}, "threads")])
def test_other_constructor_arguments(kw, name):
    _raises(lambda: _new(**kw), name)


@pytest.mark.parametrize("call,name", [
    (lambda c, x: c.reduce(x, 2**64), "root"),
    (lambda c, x: c.broadcast(x, -1), "root"),
    (lambda c, x: c.recv(x, -2), "src"),
    (lambda c, x: c.send(x, 2**70), "dst"),
    (lambda c, x: c.recv(x, None, tag=-1), "tag"),
    (lambda c, x: c.recv(x, None, tag=2**63), "tag"),
    (lambda c, x: c.subgroup([5], "five"), "ranks"),
    (lambda c, x: c.allgather_v(x, [-1]), "counts"),
], ids=["reduce-root", "broadcast-root", "recv-src", "send-dst", "tag-neg", "tag-reserved", "subgroup", "counts"])
def test_ranks_tags_and_counts(one, call, name):
    _raises(lambda: call(one, np.zeros(4, np.float32)), name)


# -- settings ----------------------------------------------------------------------------------------
CORE_SETTINGS = [
    ("PLAIT_TIMEOUT", ["1e19", "inf", "nan", "-1", "0", "soon", "1e400"]),
    ("PLAIT_SEGMENT_BYTES", ["0", "-5", "1e30", str(2**70), "1.5"]),
    ("PLAIT_STREAMS", ["0", "1000", "-1", "1.5"]),
    ("PLAIT_STREAMS_MAX", ["0", "17", "1.5"]),
    ("PLAIT_CALLER_READ_BYTES", ["-1", str(2**70), "nan"]),
    ("PLAIT_BUSY_POLL_US", ["-1", str(2**64 - 1), "inf"]),
]


@pytest.mark.parametrize("name,value,said", [
    ("PLAIT_MEASURE", "yes", "must be auto, 1 or 0"),
    ("PLAIT_RING_ORDER", "0,1", "not an order of the 1 ranks"),
    ("PLAIT_RING_ORDER", "ring", "'ring' is not a rank"),
])
def test_link_settings_are_refused_in_words(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    err = _raises(lambda: _new(), said)
    assert isinstance(err, plait.ConfigError), err


def test_a_ring_order_for_another_world_size_does_not_break_what_reads_the_settings(monkeypatch):
    """The list is checked against the world it is used in, not when the settings are read (the
    torch backend, the witness and elastic mode read them with no world yet)."""
    monkeypatch.setenv("PLAIT_RING_ORDER", "0,2,1,3")
    plait._core.env_config()


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in CORE_SETTINGS for v in vs])
def test_core_settings(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    err = _raises(lambda: _new(), f"{name}={value}", RANGE)
    assert isinstance(err, plait.ConfigError), err
    _raises(plait._core.env_config, name)


TORCH_SETTINGS = [
    ("PLAIT_TORCH_INLINE_BYTES", ["-1", "nan", "inf", str(2**70)]),
    ("PLAIT_TORCH_STAGING_CACHE", ["-1", "inf", "x"]),
    ("PLAIT_TRACE_ENTRIES", ["-1", "1e30", "x", "2.5"]),
    ("PLAIT_TIMEOUT", ["1e19", "inf"]),
]


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in TORCH_SETTINGS for v in vs])
def test_torch_settings(monkeypatch, name, value):
    pytest.importorskip("torch")
    from torch.distributed.constants import default_pg_timeout

    from plait.torch import trace
    from plait.torch.options import PlaitOptions

    monkeypatch.setenv(name, value)
    if name == "PLAIT_TRACE_ENTRIES":
        _raises(trace.entries_setting, name, RANGE)
    else:
        _raises(lambda: PlaitOptions().resolved(default_pg_timeout), name, RANGE)


@pytest.mark.parametrize("opts,name", [
    ({"timeout": datetime.timedelta.max}, "timeout"),
    ({"timeout": float("inf")}, "timeout"),
    ({"timeout": -3}, "timeout"),
    ({"inline_bytes": -1}, "inline_bytes"),
    ({"staging_cache_bytes": float("nan")}, "staging_cache_bytes"),
])
def test_torch_options(opts, name):
    pytest.importorskip("torch")
    from plait.torch.options import PlaitOptions

    _raises(lambda: PlaitOptions(**opts).resolved(None), name, RANGE)


def test_the_validator_is_the_cores():
    """Python's own arguments go through the core's ranges (one source of truth)."""
    core = plait._core
    assert core.check_argument("timeout", 2, "x") == 2.0
    assert core.check_argument("world_size", 3) == 3 and isinstance(core.check_argument("world_size", 3), int)
    assert core.check_setting("PLAIT_TIMEOUT", " 12.5 ") == 12.5
    limits = {s["name"]: (s["min"], s["max"]) for s in core.SETTINGS if s["min"] is not None}
    assert limits["PLAIT_TIMEOUT"] == (0.001, 31536000.0) and limits["PLAIT_STREAMS"] == (1, 16)
    with pytest.raises(plait.ConfigError, match=r"PLAIT_TIMEOUT=1e19: must be a number of seconds between 0.001 and 31536000"):
        core.check_setting("PLAIT_TIMEOUT", "1e19")


# -- early frames over PLAIT_UNEXPECTED_BYTES wait for their receive (flow control) ----------------
# A rank that enters a call late gets the call's data as early frames. Over the per-peer budget the
# link used to be cut ("over the ... bytes allowed per peer"); now the reader stops taking that
# peer's frames (TCP holds the sender back) until the receive is posted, and only a receive that
# never comes within the timeout fails, naming the peer, the frame and the setting.
MIB = 1 << 20


def _two_ranks(fn, timeout=60):
    """fn(rank) on a thread per rank, each with its own Communicator; returns the results."""
    out, errors = [None, None], []

    def go(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return out


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setenv("PLAIT_UNEXPECTED_BYTES", str(MIB))


def test_a_late_rank_gets_an_allreduce_16x_its_budget_right(small_budget):
    """Was: the early rank's 16 MiB arrived before rank 1 posted anything and the link was cut
    naming PLAIT_UNEXPECTED_BYTES."""
    store = torch_dist.HashStore()
    n = 4 * MIB  # float32: 16 MiB

    def rank(r):
        with plait.Communicator(store, r, 2, timeout=20) as c:
            if r == 1:
                time.sleep(1.0)
            x = np.arange(n, dtype=np.float32) + r
            return c.allreduce(x)

    for y in _two_ranks(rank):
        assert np.array_equal(y, 2 * np.arange(n, dtype=np.float32) + 1)


def test_sends_of_many_times_the_budget_before_their_receives_arrive_whole(small_budget):
    """Was: the second message went over the budget and the link was cut."""
    store = torch_dist.HashStore()
    sizes = [3 * MIB, MIB // 2, 5 * MIB]  # bytes; the largest alone is 5x the budget

    def rank(r):
        with plait.Communicator(store, r, 2, timeout=20) as c:
            if r == 0:
                works = [c.send(np.full(s, i + 1, np.uint8), 1, tag=7, async_op=True) for i, s in enumerate(sizes)]
                for w in works:
                    w.wait()
                return None
            time.sleep(1.0)
            got = []
            for s in sizes:
                out = np.zeros(s, np.uint8)
                c.recv(out, 0, tag=7)
                got.append(out)
            return got

    got = _two_ranks(rank)[1]
    for i, (s, out) in enumerate(zip(sizes, got)):
        assert out.size == s and np.all(out == i + 1), f"message {i}"


def test_a_frame_over_the_budget_that_nothing_receives_fails_at_the_timeout_naming_it(small_budget):
    """The wait for a receive is bounded: with none posted, rank 1 fails once the communicator's
    timeout has passed (not before: the receive may still come), naming rank 0, the message and
    the settings. Was: it failed at once."""
    store = torch_dist.HashStore()
    timeout = 2.0

    def rank(r):
        with plait.Communicator(store, r, 2, timeout=timeout) as c:
            if r == 0:
                try:  # its own wait outlasts rank 1's: rank 1 must be the one that gives up
                    c.send(np.ones(8 * MIB, np.uint8), 1, tag=3, timeout=30)
                except plait.PlaitError:
                    pass  # rank 1 never takes it and fails: so does this rank
                return None
            t0 = time.monotonic()
            other = c.recv(np.zeros(1, np.uint8), 0, tag=4, timeout=30, async_op=True)  # never sent
            try:
                other.wait()
            except plait.PlaitError as e:
                return e, time.monotonic() - t0
            return None

    got = _two_ranks(rank)[1]
    assert got is not None, "rank 1 never failed"
    err, after = got
    text = str(err)
    assert after >= 0.8 * timeout, f"failed after {after:.2f} s, before the timeout: {text}"
    assert after < 20, f"failed only after {after:.2f} s"
    for part in ("rank 0", "tag 3", "PLAIT_UNEXPECTED_BYTES", "PLAIT_TIMEOUT"):
        assert part in text, f"{part!r} not in: {text}"
