"""Debugging a plait job as torch users do: TORCH_DISTRIBUTED_DEBUG=DETAIL's collective checks,
and the trace every rank writes on a timeout (read by `plait trace show` and by torch's own
flight-recorder analyser)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torch_launch  # noqa: E402


def run(scenario, nproc, **kw):
    """torch_launch.run_world over debug_scenarios.py."""
    return torch_launch.run_world(scenario, nproc, script=HERE / "debug_scenarios.py", **kw)


def test_detail_finds_mismatched_calls_on_every_rank(tmp_path):
    """At DETAIL, a call whose shapes (same element count), collective or root differ between
    ranks raises on every rank, naming the ranks and what differs, instead of silently reducing
    mismatched shapes or hanging; calls that agree pass with correct results (uneven all_to_all,
    gather/scatter whose lists only the root has), on the world and on a new_group."""
    res = run("detail", 3, timeout=120, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "PLAIT_TRACE_DIR": str(tmp_path)})
    for r, x in enumerate(res):
        assert x["checked"], r
        assert all(x["ok"]), (r, x["ok"])
        for key, differs, who in (("shapes", "input tensor shapes", ("rank 1 called", "ranks 0, 2 called")),
                                  ("op_kind", "the collective", ("rank 2 called broadcast", "ranks 0, 1 called all_reduce")),
                                  ("root", "the root", ("rank 1 called broadcast", "ranks 0, 2 called broadcast")),
                                  ("sub_shapes", "input tensor shapes", ("rank 1 called", "ranks 0, 2 called"))):
            err = x[key]
            assert err is not None, (r, key)
            assert "MismatchError" in err["mro"] and "RuntimeError" in err["mro"], (r, key, err)
            assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in err["msg"] and differs in err["msg"], (r, key, err["msg"])
            for w in who:
                assert w in err["msg"], (r, key, w, err["msg"])
        assert "[[2, 4]]" in x["shapes"]["msg"] and "[[4, 2]]" in x["shapes"]["msg"]


def test_without_detail_nothing_is_checked(tmp_path):
    """At the default debug level no check runs (and nothing extra is sent)."""
    res = run("detail", 2, timeout=120, env={"TORCH_DISTRIBUTED_DEBUG": "OFF", "PLAIT_TRACE_DIR": str(tmp_path)},
              args=("shapes-only",))
    assert [x["checked"] for x in res] == [False, False]
    assert all(x["shapes"] is None for x in res)  # the core sees equal byte counts: no error


def test_a_rank_that_skips_a_collective_is_named(tmp_path):
    """Rank 2 skips an all_reduce: ranks 0 and 1 fail naming it (the first to time out relays its
    timeout to the other), every rank (rank 2 too)
    writes its trace, `plait trace show` says rank 2 never arrived (its last op the all_reduce
    before), and torch's fr_trace reads the same dumps and finds rank 2 missing."""
    d = tmp_path / "traces"
    res = run("skip", 3, timeout=120, env={"PLAIT_TRACE_DIR": str(d)}, args=(4,))
    assert all(x["dumped"] for x in res), res
    errs = [res[r]["error"] for r in (0, 1)]
    # The first rank to time out fails the others with its reason (a PeerError that relays it):
    # whichever it is, every error names rank 2 as the one that did not send.
    assert any(e is not None and "PlaitTimeoutError" in e["mro"] for e in errs), errs
    for err in errs:
        assert err is not None and ("PlaitTimeoutError" in err["mro"] or "PeerError" in err["mro"]), err
        assert "Timed out" in err["msg"] and "waiting for rank 2 " in err["msg"], err["msg"]
        assert str(d) in err["msg"] and "plait trace show" in err["msg"], err["msg"]
    p = subprocess.run([sys.executable, "-m", "plait.tools.cli", "trace", "show", str(d)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "all_reduce #5 (float32, 1024 elems)" in p.stdout, p.stdout
    assert "rank 2 never arrived (its last op: all_reduce #4" in p.stdout, p.stdout
    p = subprocess.run([sys.executable, "-m", "plait.tools.cli", "trace", "show", str(d), "--json", "-"],
                       capture_output=True, text=True, timeout=60)
    rep = json.loads(p.stdout)
    (g,) = rep["groups"]
    assert g["never_arrived"] == [2] and sorted(g["failed"] + g["waiting"]) == [0, 1] and g["no_trace"] == []
    assert g["op"]["op"] == "all_reduce" and g["op"]["collective_seq_id"] == 5
    fr = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(d)],
                        capture_output=True, text=True, timeout=120)
    assert fr.returncode == 0, fr.stderr[-3000:]
    out = fr.stdout + fr.stderr
    assert "missing ranks: {2}" in out, out[-3000:]


def test_trace_entries_setting():
    """PLAIT_TRACE_ENTRIES keeps the last N calls of each group; 0 keeps none."""
    res = run("entries", 2, timeout=120, env={"PLAIT_TRACE_ENTRIES": "5"})
    for x in res:
        (name, n, seqs), = x["groups"]
        assert n == 5 and seqs == [16, 17, 18, 19, 20], x
    res = run("entries", 2, timeout=120, env={"PLAIT_TRACE_ENTRIES": "0"})
    assert all(x["groups"] == [] for x in res), res
