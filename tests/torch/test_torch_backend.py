"""The "plait" torch.distributed backend: every collective against references, errors, lifecycle.

Each test launches a world of local processes (torch_launch.py) running a scenario of
torch_scenarios.py; the scenario checks every result on every rank and reports failures.
"""

import datetime
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_launch import run_world  # noqa: E402


def _no_failures(results):
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:40])
    return sum(r["checks"] for r in results)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_matrix(world):
    """all_reduce (every op incl. AVG and PREMUL_SUM, every dtype incl. bf16/f16/complex/bool),
    reduce, broadcast, all_gather (list, uneven, into tensor, in place), gather, scatter,
    reduce_scatter, all_to_all (list, single, uneven), send/recv (ordering, tags, any source),
    batch_isend_irecv, barrier, coalesced ops, object and functional collectives; on the world,
    on subgroups, on a group that stages tensors as CUDA ones would be, and on one that never
    runs inline."""
    checks = _no_failures(run_world("collectives", world, timeout=240))
    assert checks > 1000 * world


def test_point_to_point_order():
    """Between two ranks, on a default group and on one that never runs inline: 40 isends on one
    tag (small and large alternating) land in order, received by blocking recv and by irecv;
    receives posted before their sends; batch_isend_irecv both ways with several messages per
    peer; any-source receives in send order; a pending receive does not hold up a collective."""
    assert _no_failures(run_world("p2p", 2, timeout=120)) > 100


def test_errors_and_lifecycle():
    """Refused arguments raise ValueError+RuntimeError before anything is sent; a mismatch fails
    every rank fast; a per-op timeout names the peers; a failed op errors its future at the C++
    level; destroy + re-init (tcp://, file:// twice on one file, env://) work and leave no
    threads behind."""
    results = run_world("errors", 3, timeout=240)
    _no_failures(results)
    msgs = [r["mismatch"] for r in results]
    assert all(msgs), msgs  # every rank raised
    assert any("mismatch" in m.lower() for m in msgs), msgs


def test_mixed_backend_config():
    """backend="cpu:plait,cuda:gloo" (gloo stands in for nccl, which needs GPUs)."""
    _no_failures(run_world("mixed", 3, timeout=120))


@pytest.mark.parametrize("config", ["plait", "cpu:plait", "cpu:plait,cuda:gloo", "cuda:gloo,cpu:plait"])
def test_creator_tells_a_mixed_group_from_plait_alone(config):
    """plait alone (however named) is the whole ProcessGroup; beside another backend it is the CPU
    device's Backend of torch's own group (a world of one, in this process)."""
    import plait.torch  # noqa: F401
    from plait.torch.backend import PlaitBackend, PlaitProcessGroup

    if not hasattr(dist.distributed_c10d._DistributedBackendOptions(), "process_group"):
        pytest.skip("this torch does not hand the creator the group it builds")
    port = __import__("torch_launch").free_port()
    dist.init_process_group(config, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        assert (type(pg) is PlaitProcessGroup) == ("gloo" not in config), type(pg)
        assert isinstance(pg._get_backend(torch.device("cpu")), PlaitBackend)
        t = torch.arange(3.0)
        dist.all_reduce(t)
        assert torch.equal(t, torch.arange(3.0))
    finally:
        dist.destroy_process_group()


def test_register_is_idempotent_and_lists_devices():
    import plait.torch as pt

    pt.register()
    pt.register()
    assert "PLAIT" in dist.Backend._plugins
    assert dist.Backend.backend_capability["plait"] == ["cpu", "cuda", "mps"]


def test_options_validation(monkeypatch):
    from plait._core import ConfigError
    from plait.torch import PlaitOptions
    from plait.torch.options import from_pg_options

    o = PlaitOptions(timeout=datetime.timedelta(seconds=7), wire_dtype="bfloat16").resolved(datetime.timedelta(minutes=30))
    assert o.timeout == 7 and o.wire_dtype == "bf16" and o.inline == "auto"
    monkeypatch.setenv("PLAIT_TIMEOUT", "12")
    from torch.distributed.constants import default_pg_timeout

    assert PlaitOptions().resolved(default_pg_timeout).timeout == 12  # env beats torch's default
    assert PlaitOptions().resolved(datetime.timedelta(seconds=5)).timeout == 5  # an explicit torch timeout beats env
    with pytest.raises(ConfigError):
        PlaitOptions(wire_dtype="int3").resolved(None)
    with pytest.raises(ConfigError):
        from_pg_options({"no_such_option": 1})
    assert from_pg_options({"algo": "allreduce:ring"}).algo == "allreduce:ring"


def test_single_process_world():
    """World of one, in this process: every op is a local copy; destroy and re-init."""
    import plait.torch  # noqa: F401

    port = __import__("torch_launch").free_port()
    for _ in range(2):
        dist.init_process_group("plait", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            t = torch.arange(4.0)
            dist.all_reduce(t)
            assert torch.equal(t, torch.arange(4.0))
            outs = [torch.zeros(4)]
            dist.all_gather(outs, t)
            assert torch.equal(outs[0], t)
            o = torch.zeros(4)
            dist.all_to_all_single(o, t)
            assert torch.equal(o, t)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        port = __import__("torch_launch").free_port()
