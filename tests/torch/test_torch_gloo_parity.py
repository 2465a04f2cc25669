"""Calls written the ways people write them for gloo give gloo's results on plait: each scenario
of gloo_parity_scenarios.py runs on both backends (3 ranks) and every case must have the same
outcome (the same values, or a refusal on both)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from torch_launch import WorldFailed, run_world  # noqa: E402

SCRIPT = HERE / "gloo_parity_scenarios.py"


def both(scenario, nproc=3):
    return {"gloo": reference(scenario, nproc), "plait": run_world(scenario, nproc, args=["plait"], script=SCRIPT, timeout=180)}


def reference(scenario, nproc):
    """gloo's outcomes. gloo sometimes aborts a rank as the process exits, after its result is
    written ("terminate called without an active exception", seen after DDP join, as in
    test_clients.py): the reference alone is run once more then."""
    try:
        return run_world(scenario, nproc, args=["gloo"], script=SCRIPT, timeout=180)
    except WorldFailed as e:
        if "terminate called without an active exception" not in str(e):
            raise
        return run_world(scenario, nproc, args=["gloo"], script=SCRIPT, timeout=180)


def differences(results, gloo_fails=()):
    """Cases whose outcomes differ, but for those in `gloo_fails`, where gloo raises and plait
    must give a result."""
    gloo, plait = results["gloo"], results["plait"]
    diffs = []
    for rank, (g, p) in enumerate(zip(gloo, plait)):
        for name in sorted(set(g) | set(p)):
            if name in gloo_fails:
                if not str(g.get(name)).startswith("raised") or str(p.get(name)).startswith("raised"):
                    diffs.append(f"rank {rank} {name}: expected gloo to raise and plait not to: gloo {g.get(name)!r} plait {p.get(name)!r}")
                continue
            if g.get(name, "<missing>") != p.get(name, "<missing>"):
                diffs.append(f"rank {rank} {name}: gloo {g.get(name, '<missing>')!r} plait {p.get(name, '<missing>')!r}")
    return diffs


def test_keyword_forms():
    """pg.broadcast(t, root=0), pg.allreduce(t, op=ReduceOp.MAX), reduce/gather/scatter(...,
    root=), reduce_scatter(..., op=), timeout= and opts= by keyword; an unknown keyword is a
    TypeError on both."""
    r = both("keywords")
    assert not differences(r), "\n".join(differences(r))
    assert r["plait"][0]["allreduce(t, bogus=)"] == "raised TypeError"


def test_futures_under_inference_mode():
    """work.get_future().wait() of every collective issued under torch.inference_mode()."""
    r = both("inference_mode")
    # gloo 2.15 fails these two under inference mode ("Inplace update to inference tensor")
    d = differences(r, gloo_fails=("reduce_scatter", "reduce_scatter_tensor"))
    assert not d, "\n".join(d)
    assert not any(str(v).startswith("raised") for v in r["plait"][0].values()), r["plait"][0]


def test_several_tensors_per_process():
    """allreduce of several tensors (each gets the reduction of all of them on every rank),
    broadcast with rootTensor, allgather with several inputs; the forms gloo refuses are refused,
    and the group still works after the refusals."""
    r = both("several_tensors")
    assert not differences(r), "\n".join(differences(r))
    assert r["plait"][0]["reduce two tensors (refused)"].startswith("raised")


def test_split_group_set_timeout_and_options():
    """dist.split_group (ranks in the given order), dist.set_timeout cutting a group's timeout
    from 60 s to 2 s for a member that never arrives, and the backend's options."""
    r = both("groups")
    assert not differences(r), "\n".join(differences(r))
    p = r["plait"]
    assert p[0]["split member"] and p[0]["split rank and size"] == (1, 2, 1, 2)
    assert p[0]["late peer raised within 5 s (the new 2 s timeout, not 60 s)"] is True
    assert p[0]["options follow set_timeout"] is True


def test_ddp_join_with_uneven_inputs():
    """DDP's join context, dividing by the initial world size and by the ranks still training
    (the reducer waits in backward on a Work that Python already dropped: it hung before)."""
    r = both("ddp_join")
    assert not differences(r), "\n".join(differences(r))


def test_a_call_refused_on_one_rank_fails_every_rank():
    """Arguments one rank refuses (its own output slot too big, a root out of range, AVG on
    integers, one input short) end the call on every rank at once, naming that rank and the
    reason, not after the 30 s timeout; the group goes on working, subgroups too. A rank whose
    part needs nothing from the refusing one may complete its part (which ranks those are depends
    on the algorithm: a broadcast's root, or a receiver the root sends to directly), so the
    broadcast case has the root itself refuse.
    (gloo raises on the refusing rank only and leaves the others waiting: not compared.)"""
    results = run_world("refusals", 3, args=["plait"], script=SCRIPT, timeout=180)
    cases = {
        "all_gather, rank 0's own slot wrong": (0, "output tensor 0 has 5 elements"),
        "broadcast, rank 1's root out of range": (1, "out of range"),
        "int all_reduce, rank 2 asks for AVG": (2, "avg"),
        "async reduce_scatter, rank 0 one input short": (0, "expected 3 input tensors"),
    }
    for name, (refuser, why) in cases.items():
        for rank, r in enumerate(results):
            msg, took = r[name]
            assert msg.startswith("InvalidArgumentError"), (rank, name, msg)
            assert why.lower() in msg.lower(), (rank, name, msg)
            if rank != refuser:
                assert f"rank {refuser} refused this call" in msg, (rank, name, msg)
            assert took < 10, (rank, name, took)
    for rank, r in enumerate(results):
        assert r["the same refusal on every rank"][0].startswith("InvalidArgumentError"), r
        assert "refused this call" not in r["the same refusal on every rank"][0], r
        assert r["barrier after"][0] == "completed", r
        assert r["all_reduce after"][0] == "completed", r
        assert r["all_reduce after value"] == [6.0] * 3, r
    msg, took = results[1]["subgroup all_gather_into_tensor, rank 2 wrong size"]
    assert "rank 1 refused this call" in msg and took < 10, msg  # rank 2 of the world is rank 1 of [1, 2]
