"""Custom schedules as a user writes them: the schedule language compiles to verified schedules
(the ring program to exactly the built-in ring), files follow the documented format and its JSON
Schema, wrong schedules are refused in words that say what is missing, and `plait schedule`
checks, draws and prices them."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait import _core
from plait import schedule as S
from plait.schedule import Program

ROOT = Path(__file__).resolve().parent.parent
RING = ROOT / "examples" / "schedules" / "ring_allreduce.py"
SCHEMA = ROOT / "docs" / "schedule.schema.json"
CLI = [sys.executable, "-m", "plait.tools.cli"]


def _module(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.mark.parametrize("n", range(1, 9))
def test_the_ring_program_compiles_to_the_built_in_ring(n):
    prog = _module(RING).build(n)
    facts = prog.check()
    assert facts["collective"] == "allreduce" and facts["nranks"] == n
    assert prog.compile()["ranks"] == json.loads(S.builtin("allreduce", "ring", n))["ranks"]


def _star_allgather(n):
    p = Program("allgather", n, name="star")
    for r in range(n):
        mine = p.input(r, 0)
        mine.copy(p.output(r, r))
        for q in range(n):
            if q != r:
                mine.copy(p.output(q, r))
    return p


def _direct_reduce_scatter(n):
    # Every rank sends block q straight to rank q, which accumulates them into its output.
    p = Program("reduce_scatter", n, name="direct_rs")
    for q in range(n):
        p.input(q, q).copy(p.output(q, 0))
        for r in range(n):
            if r != q:
                p.output(q, 0).reduce(p.input(r, q))
    return p


def _chain_broadcast(n, root):
    p = Program("broadcast", n, name="chain_bc", root=root)
    order = [(root + i) % n for i in range(n)]
    for b in range(n):
        p.input(root, b).copy(p.output(root, b))
        cur = p.input(root, b)  # sent from the input: no wait for the local copy
        for r in order[1:]:
            cur = cur.copy(p.output(r, b))
    return p


def _two_level_allreduce(n):
    # Reduce everything onto rank 0 through scratch, then send the sum back: uses scratch slots.
    p = Program("allreduce", n, name="gather_sum")
    for b in range(n):
        acc = p.input(0, b).copy(p.scratch(0, b))
        for r in range(1, n):
            acc.reduce(p.input(r, b))
        acc.copy(p.output(0, b))
        for r in range(1, n):
            acc.copy(p.output(r, b))
    return p


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_programs_for_several_collectives_compile_and_verify_in_and_out_of_place(n):
    facts = _star_allgather(n).check()
    assert facts["steps"] == 1 and facts["transfers"] == n * (n - 1)
    assert _direct_reduce_scatter(n).check()["transfers"] == n * (n - 1)
    for root in {0, n - 1}:
        f = _chain_broadcast(n, root).check()
        assert f["root"] == root and f["steps"] == max(n - 1, 1)
    f = _two_level_allreduce(n).check()
    assert f["scratch_slots"] == 1


def test_the_compiler_places_each_operation_in_the_first_step_its_data_allows():
    def chain(from_input):
        p = Program("broadcast", 3, name="two_hops")
        for b in range(3):
            local = p.input(0, b).copy(p.output(0, b))
            first = p.input(0, b) if from_input else local
            first.copy(p.output(1, b)).copy(p.output(2, b))
        p.check()
        return p.compile()["ranks"]

    # From the input, the hop 0 -> 1 depends on nothing: step 0 (with the local copies), and
    # 1 -> 2 follows in step 1.
    ranks = chain(True)
    assert len(ranks[0]) == 2
    assert [len(s.get("sends", [])) for s in ranks[0]] == [3, 0]
    assert [len(s.get("sends", [])) for s in ranks[1]] == [0, 3]
    assert len(ranks[0][0]["locals"]) == 3
    # From the output, the hop waits for the local copy of step 0: one step more.
    ranks = chain(False)
    assert [len(s.get("sends", [])) for s in ranks[0]] == [0, 3, 0]
    assert [len(s.get("sends", [])) for s in ranks[1]] == [0, 0, 3]


def test_reductions_into_a_chunk_that_shares_memory_in_place_compile_right_both_ways():
    # A receive reduced with the destination's in-place partner is a plain write out of place:
    # it must not share a step with the accumulation that follows (review finding).
    p = Program("reduce_scatter", 3, name="partner_base")
    for q in range(3):
        o0, o1 = [r for r in range(3) if r != q]
        p.input(o0, q).copy(p.output(q, 0), reduce_with=p.input(q, q))
        p.output(q, 0).reduce(p.input(o1, q))
    p.check()


@pytest.mark.parametrize("order", ["scratch_into_input", "input_into_scratch"])
def test_local_reductions_with_an_in_place_partner_compile_right_both_ways(order):
    # dst = base (+) src, local, where base or src is dst's partner (review findings).
    p = Program("allreduce", 2, name="local_forms")
    for b in range(2):
        other = 1 - b
        p.input(other, b).copy(p.scratch(b, b))
        if order == "scratch_into_input":
            p.scratch(b, b).copy(p.output(b, b), reduce_with=p.input(b, b))
        else:
            p.input(b, b).copy(p.output(b, b), reduce_with=p.scratch(b, b))
        p.output(b, b).copy(p.output(other, b))
    p.check()


def test_a_wrong_program_is_refused_naming_what_never_arrives():
    p = Program("allgather", 3, name="forgetful")
    for r in range(3):
        p.input(r, 0).copy(p.output(r, r))
        for q in range(3):
            if q != r and not (r == 1 and q == 2):
                p.input(r, 0).copy(p.output(q, r))
    with pytest.raises(S.ScheduleError, match=r"rank 2 never receives output\[1\].*block 1 from rank 1"):
        p.check()
    # A reduce_scatter that forgets one rank's contribution.
    p = Program("reduce_scatter", 3, name="short")
    for q in range(3):
        p.input(q, q).copy(p.output(q, 0))
        for r in range(3):
            if r != q and (q, r) != (0, 2):
                p.output(q, 0).reduce(p.input(r, q))
    with pytest.raises(S.ScheduleError, match=r"contribution of rank\(s\) 2 never reaches it"):
        p.check()


def test_programs_refuse_what_cannot_be_written():
    p = Program("allreduce", 2, name="x")
    with pytest.raises(S.ScheduleError, match="read only"):
        p.output(0, 0).copy(p.input(1, 0))
    with pytest.raises(S.ScheduleError, match="out of range"):
        p.input(2, 0)
    with pytest.raises(S.ScheduleError, match="unknown collective"):
        Program("allsum", 2, name="x")
    with pytest.raises(S.ScheduleError, match="must be on the destination's rank"):
        p.input(0, 0).copy(p.output(1, 0), reduce_with=p.input(0, 0))


def _schema_validator():
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))


def test_every_built_in_file_and_compiled_program_follows_the_json_schema():
    v = _schema_validator()
    n = 4
    for name in S.COLLECTIVES:
        for algo in _core.algorithms(name):
            doc = json.loads(S.builtin(name, algo, n, root=1))
            errors = list(v.iter_errors(doc))
            assert not errors, (name, algo, errors[0].message)
    for prog in (_star_allgather(3), _two_level_allreduce(3), _chain_broadcast(3, 2)):
        assert not list(v.iter_errors(prog.compile()))
    # The schema refuses what the reader refuses.
    bad = json.loads(S.builtin("allgather", "ring", 3, name="mine"))
    bad["ranks"][0][0]["sends"][0]["per"] = 1
    assert list(v.iter_errors(bad))
    del bad["version"]
    assert list(v.iter_errors(bad))


def test_files_are_refused_in_words_that_say_what_to_change():
    good = S.builtin("allgather", "ring", 3, name="mine")
    assert S.check(good)["name"] == "mine"
    with pytest.raises(S.ScheduleError, match="add \"version\": 1"):
        S.check(good.replace('"version": 1,', ""))
    with pytest.raises(S.ScheduleError, match="reads version 1"):
        S.check(good.replace('"version": 1', '"version": 7'))
    with pytest.raises(S.ScheduleError, match="unknown field `per`"):
        S.check(good.replace('"peer"', '"per"', 1))
    with pytest.raises(S.ScheduleError, match="is a built-in allgather algorithm"):
        S.check(S.builtin("allgather", "ring", 3))
    assert S.check(S.builtin("allgather", "ring", 3), custom=False)["name"] == "ring"


def _plait(*args, cwd=None):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120, cwd=cwd)


def test_plait_schedule_check_show_simulate_and_builtin(tmp_path):
    r = _plait("schedule", "check", str(RING), "--nranks", "2,3,4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ok  ") == 3 and "allreduce 'dsl_ring' for 4 ranks, 6 steps, 24 transfers" in r.stdout
    out = tmp_path / "mine.json"
    r = _plait("schedule", "builtin", "allgather", "direct", "--nranks", "3", "--name", "mine", "-o", str(out))
    assert r.returncode == 0, r.stderr
    r = _plait("schedule", "check", str(out), "--json", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["results"][0]["name"] == "mine"
    out.write_text(out.read_text().replace('"peer":1,"src"', '"peer":2,"src"', 1))
    r = _plait("schedule", "check", str(out))
    assert r.returncode == 1 and "FAIL" in r.stdout and "no matching send" in r.stdout
    r = _plait("schedule", "check", str(tmp_path / "absent.json"))
    assert r.returncode == 1 and "no such file" in r.stderr
    r = _plait("schedule", "simulate", str(RING), "--nranks", "4", "--sizes", "4K,16M", "--json", "-")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"][0]["predicted_seconds"]
    assert rows["dsl_ring"] == rows["ring"] and set(_core.algorithms("allreduce")) <= set(rows)
    r = _plait("schedule", "simulate", "builtin:allgather:ring", "--nranks", "3")
    assert r.returncode == 0 and "best" in r.stdout, r.stderr
    pytest.importorskip("matplotlib")
    for ext in ("svg", "png"):
        pic = tmp_path / f"ring.{ext}"
        r = _plait("schedule", "show", str(RING), "--nranks", "3", "-o", str(pic))
        assert r.returncode == 0, r.stderr
        assert pic.stat().st_size > 1000
    assert "<svg" in (tmp_path / "ring.svg").read_text()[:2000]
    r = _plait("schedule", "show", str(RING), "--nranks", "2,3", "-o", str(tmp_path / "x.svg"))
    assert r.returncode == 1 and "one --nranks" in r.stderr


RD = ROOT / "examples" / "schedules" / "rd_allgather.py"


def test_plait_schedule_bench_runs_a_program_next_to_the_built_ins_with_right_results():
    r = subprocess.run(CLI + ["schedule", "bench", str(RD), "--nranks", "2", "-b", "1K", "-e", "4K", "-n", "5",
                              "-w", "1", "--no-gloo", "--json", "-"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)["results"]
    backends = {row["backend"] for row in rows}
    assert backends == {"plait:rd_allgather", "plait:ring", "plait:direct"}, backends
    assert all(row["wrong"] == 0 for row in rows)
    # The custom backend really ran the custom schedule.
    assert {row["algorithm"] for row in rows if row["backend"] == "plait:rd_allgather"} == {"rd_allgather"}


def test_a_broken_registered_schedule_fails_the_communicator_naming_the_file(tmp_path):
    bad = tmp_path / "broken.json"
    doc = json.loads(S.builtin("allgather", "ring", 2, name="mine"))
    doc["ranks"][0][0]["sends"] = []
    bad.write_text(json.dumps(doc))
    with pytest.raises(_core.ConfigError, match=r"broken\.json.*'mine' \(allgather for 2 ranks\) is wrong"):
        _core.Comm(None, 0, 2, schedules=str(tmp_path))
    with pytest.raises(_core.ConfigError, match="PLAIT_SCHEDULES: .*absent"):
        _core.Comm(None, 0, 2, schedules=str(tmp_path / "absent"))
    # Two files defining one name for the same world size are refused, naming both.
    (tmp_path / "broken.json").unlink()
    for f in ("a.json", "b.json"):
        (tmp_path / f).write_text(S.builtin("allgather", "ring", 2, name="dup"))
    with pytest.raises(_core.ConfigError, match=r"b\.json and .*a\.json both define allgather 'dup'"):
        _core.Comm(None, 0, 2, schedules=str(tmp_path))
    assert S.paths_setting([tmp_path / "a.json", "x"]) == os.pathsep.join([str(tmp_path / "a.json"), "x"])


HIER = ROOT / "examples" / "schedules" / "hier_allreduce.py"


def test_the_hierarchical_example_file_is_its_program_compiled_and_sends_the_cable_the_least():
    text = (ROOT / "examples" / "schedules" / "hier_allreduce.json").read_text()
    assert text == _module(HIER).build(4).to_json(), "recompile: plait schedule compile " \
        "examples/schedules/hier_allreduce.py --nranks 4 -o examples/schedules/hier_allreduce.json"
    # Host of rank r: r // 2. Bytes each host sends the other, in blocks of the 4-block layout.
    for n in (4, 6, 8):
        doc = json.loads(_module(HIER).build(n).to_json())
        k = n // 2
        across = sum(1 for r, prog in enumerate(doc["ranks"]) for st in prog for op in st.get("sends", [])
                     if r // k == 0 and op["peer"] // k == 1)
        assert across == n  # every block once: the whole buffer, the least two hosts can exchange
        ring = json.loads(S.builtin("allreduce", "ring", n))
        assert sum(1 for r, prog in enumerate(ring["ranks"]) for st in prog for op in st.get("sends", [])
                   if r // k == 0 and op["peer"] // k == 1) == 2 * (n - 1)


def test_plait_schedule_compile_writes_verified_files(tmp_path):
    out = tmp_path / "h.json"
    r = _plait("schedule", "compile", str(HIER), "--nranks", "4", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["nranks"] == 4 and "digest" in r.stderr
    r = _plait("schedule", "compile", str(HIER), "--nranks", "4,6", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.glob("hier_allreduce-*.json")) == ["hier_allreduce-4.json",
                                                                               "hier_allreduce-6.json"]
    r = _plait("schedule", "compile", str(HIER), "--nranks", "4,6", "-o", str(out))
    assert r.returncode == 1 and "existing directory" in r.stderr
    r = _plait("schedule", "compile", str(HIER), "--nranks", "3")
    assert r.returncode != 0 and "even number of ranks" in r.stderr


def test_plait_schedule_bench_under_a_launcher_is_one_of_its_ranks():
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    r = subprocess.run(CLI + ["schedule", "bench", str(HIER), "--nranks", "4", "--no-gloo"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 1 and "launcher started 2 ranks" in r.stderr, r.stderr


def test_plait_schedule_simulate_on_hosts_prices_what_crosses_between_them():
    r = _plait("schedule", "simulate", str(HIER), "--nranks", "4", "--sizes", "16M", "--hosts", "2", "--json", "-")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"][0]["predicted_seconds"]
    assert min(rows, key=lambda a: rows[a][0]) == "hier_allreduce", rows
    assert rows["ring"][0] < rows["direct"][0]
    r = _plait("schedule", "simulate", str(HIER), "--nranks", "4", "--sizes", "16M", "--json", "-")
    rows = json.loads(r.stdout)["results"][0]["predicted_seconds"]
    assert min(rows, key=lambda a: rows[a][0]) != "hier_allreduce", rows
    r = _plait("schedule", "simulate", str(HIER), "--nranks", "4", "--hosts", "3")
    assert r.returncode == 1 and "do not split evenly over 3 hosts" in r.stderr
