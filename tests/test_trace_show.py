"""`plait trace show` on traces written by hand: the first call where ranks differ, the rank
that never arrived, a rank that wrote nothing, several jobs in one directory."""

import json
import subprocess
import sys


def entry(seq, op="all_reduce", state="completed", shape=(1024,), dtype="float32", error=None):
    return {"record_id": seq - 1, "collective_seq_id": seq, "p2p_seq_id": 0, "op": op, "is_p2p": False, "peer": None,
            "root": None, "reduce_op": "sum", "input_sizes": [list(shape)], "input_dtypes": [dtype],
            "output_sizes": [list(shape)], "output_dtypes": [dtype], "state": state, "time_created_ns": seq,
            "time_started_ns": seq, "time_ended_ns": None, "duration_ms": None, "timeout_ms": 1000, "error": error,
            "group": "0"}


def write(d, rank, entries, job="j1", t=1, ranks=(0, 1, 2, 3)):
    doc = {"plait_trace": 1, "rank": rank, "job": job, "host": "h", "pid": 1, "time_ns": t, "reason": "test",
           "groups": [{"name": "0", "desc": "default_pg", "id": "0", "ranks": list(ranks), "rank": rank,
                       "size": len(ranks), "global_rank": rank, "collectives": len(entries), "p2p": 0,
                       "closed": False, "entries": entries}]}
    (d / f"plait_trace_rank_{rank}.json").write_text(json.dumps(doc))


def show(d, *extra):
    p = subprocess.run([sys.executable, "-m", "plait.tools.cli", "trace", "show", str(d), *extra],
                       capture_output=True, text=True, timeout=60)
    return p


def test_names_the_rank_that_never_arrived(tmp_path):
    for r in (0, 1, 3):
        write(tmp_path, r, [entry(s) for s in range(1, 42)] + [entry(42, state="started")])
    write(tmp_path, 2, [entry(s) for s in range(1, 42)])
    p = show(tmp_path)
    assert p.returncode == 0, p.stderr
    assert ("group 0 (default_pg): all_reduce #42 (float32, 1024 elems): ranks 0,1,3 waiting; "
            "rank 2 never arrived (its last op: all_reduce #41 (float32, 1024 elems), completed)") in p.stdout, p.stdout
    rep = json.loads(show(tmp_path, "--json", "-").stdout)
    (g,) = rep["groups"]
    assert g["waiting"] == [0, 1, 3] and g["never_arrived"] == [2] and g["diverged"] is None


def test_first_difference_and_missing_trace(tmp_path):
    write(tmp_path, 0, [entry(1), entry(2, shape=(4, 2), state="started")])
    write(tmp_path, 1, [entry(1), entry(2, shape=(2, 4), state="started")])
    write(tmp_path, 2, [entry(1), entry(2, op="broadcast", shape=(8,), state="started")])
    p = show(tmp_path)
    assert "the ranks made different calls at #2" in p.stdout, p.stdout
    assert "rank 0 all_reduce (inputs [[4, 2]]" in p.stdout and "rank 2 broadcast" in p.stdout, p.stdout
    assert "rank 3 wrote no trace" in p.stdout, p.stdout


def test_newest_job_by_default(tmp_path):
    """A 4-rank job's traces, then a 2-rank job's over ranks 0 and 1: the newer is read, the
    older named."""
    for r in range(4):
        write(tmp_path, r, [entry(1)], job="old", t=1)
    write(tmp_path, 0, [entry(1), entry(2, state="started")], job="new", t=2, ranks=(0, 1))
    write(tmp_path, 1, [entry(1)], job="new", t=2, ranks=(0, 1))
    p = show(tmp_path)
    assert "(job new)" in p.stdout and "rank 1 never arrived" in p.stdout, p.stdout
    assert "other jobs there: old" in p.stdout, p.stdout
    p = show(tmp_path, "--job", "old")
    assert "traces of ranks 2,3" in p.stdout and "rank 0 wrote no trace" in p.stdout, p.stdout  # overwritten by the new job


def test_no_traces(tmp_path):
    p = show(tmp_path)
    assert p.returncode == 1 and "no plait traces" in p.stderr
