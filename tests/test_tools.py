"""The `plait` tools as a user runs them: arguments that cannot work are usage errors, `--json`
means the same in every tool (PATH writes a file, `-` writes stdout and nothing else goes there),
and every tool works without rich (plain text)."""

import json
import os
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-m", "plait.tools.cli"]
BOX = set("│┃━─┏┡└┼╇")  # rich's table borders


def _plait(args, *, timeout=120, no_rich=None, cwd=None, env=None):
    env = dict(os.environ, COLUMNS="120", **(env or {}))
    if no_rich is not None:  # a `rich` module that cannot be imported, in this process and its children
        no_rich.mkdir(exist_ok=True)
        (no_rich / "rich.py").write_text("raise ImportError('rich is hidden for this test')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(no_rich)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


@pytest.mark.parametrize("args, says", [
    (["-b", "64", "-e", "8"], "-b/--minbytes 64 is above -e/--maxbytes 8"),
    (["-b", "1M", "-e", "64K"], "-b/--minbytes 1M is above -e/--maxbytes 64K"),
    (["-f", "1"], "-f/--stepfactor 1 must be above 1"),
    (["-f", "0.5"], "-f/--stepfactor 0.5 must be above 1"),
    (["-n", "0"], "-n/--iters 0 must be at least 1"),
    (["-w", "-1"], "-w/--warmup -1 must be 0 or more"),
    (["--nproc", "0"], "--nproc 0 must be at least 1"),
    (["--timeout", "0"], "--timeout 0 must be above 0"),
    (["-c", "2"], "argument -c/--check: invalid choice: 2"),
])
def test_bench_refuses_arguments_no_sweep_can_run(args, says):
    proc = _plait(["bench"] + args, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "usage: " in proc.stderr and "plait bench: error: " + says in proc.stderr, proc.stderr
    assert not proc.stdout  # no (empty) table


def test_doctor_json_to_stdout_or_a_file_and_no_direct_link_warning_on_one_host(tmp_path):
    """Two ranks on one host share every subnet; loopback is their route, not a fallback from a
    'direct link'. `--json -` (and `--json` alone, as before) print the report as JSON alone on
    stdout; `--json PATH` writes it there and prints the tables as usual."""
    for flag in (["--json", "-"], ["--json"]):
        proc = _plait(["doctor", "--local", "2", "--no-bandwidth"] + flag)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rep = json.loads(proc.stdout)  # the whole of stdout
        assert rep["world_size"] == 2 and len(rep["routes"]) == 2, rep
        assert rep["ring_order"] == [0, 1], rep
        assert not [w for w in rep["warnings"] if w["code"] == "lan_fallback" or "direct" in w["message"]], \
            rep["warnings"]
    path = tmp_path / "doctor.json"
    proc = _plait(["doctor", "--local", "2", "--no-bandwidth", "--json", str(path)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Routes" in proc.stdout and "direct" not in proc.stdout, proc.stdout
    assert json.loads(path.read_text())["world_size"] == 2


def test_doctor_says_which_links_carry_payloads_in_shared_memory():
    """Ranks of one host pass large payloads through shared memory (Windows: TCP only), and the
    doctor says so per route; with PLAIT_SHM_BYTES=0 no route does."""
    for setting, want in (("4194304", sys.platform != "win32"), ("0", False)):
        proc = _plait(["doctor", "--local", "2", "--no-bandwidth", "--json", "-"], env={"PLAIT_SHM_BYTES": setting})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        routes = json.loads(proc.stdout)["routes"]
        assert [r["shared_memory"] for r in routes] == [want, want], (setting, routes)
    proc = _plait(["doctor", "--local", "2", "--no-bandwidth"])
    assert ("in shared memory" in proc.stdout) == (sys.platform != "win32"), proc.stdout[-3000:]


def test_doctor_measure_shows_the_matrix_start_up_measured():
    """`plait doctor --measure`: the core measures every link at start-up though the ranks share a
    host, and the report holds that matrix (the same the cost model and ring order use), in JSON
    and as a table; without it, ranks on one host are not measured and there is none."""
    proc = _plait(["doctor", "--local", "3", "--no-bandwidth", "--measure", "--json", "-"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    links = json.loads(proc.stdout)["start_up_links"]
    for i in range(3):
        for j in range(3):
            if i != j:
                assert links["bytes_per_s"][i][j] > 1e6 and links["latency_s"][i][j] > 0, links
    proc = _plait(["doctor", "--local", "2", "--no-bandwidth", "--measure"])
    assert proc.returncode == 0 and "Links as start-up measured them" in proc.stdout, proc.stdout[-3000:]
    proc = _plait(["doctor", "--local", "2", "--no-bandwidth", "--json", "-"])
    assert json.loads(proc.stdout)["start_up_links"] is None


def test_topology_measures_links_predicts_and_benches_every_allreduce_algorithm(tmp_path):
    """`plait topology --local 3 --bench`: every rank measures its links (PLAIT_MEASURE=1 here,
    though they share a host), and rank 0 reports the matrix, the ring order and, for each size
    and allreduce algorithm, the cost model's prediction next to the slowest rank's median."""
    proc = _plait(["topology", "--local", "3", "--bench", "--sizes", "4K,256K", "--iters", "2", "--json", "-"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert rep["world_size"] == 3 and sorted(rep["ring_order"]) == [0, 1, 2] and rep["ring_order"][0] == 0
    bw = rep["links"]["bytes_per_s"]
    assert all((bw[i][j] is None) == (i == j) for i in range(3) for j in range(3)), bw
    assert all(bw[i][j] > 1e6 for i in range(3) for j in range(3) if i != j), bw
    import plait

    algos = plait._core.algorithms("allreduce")
    assert [(r["bytes"], r["algorithm"]) for r in rep["rows"]] == [(b, a) for b in (4096, 262144) for a in algos]
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rep["rows"]), rep["rows"]
    assert sum(r["chosen"] for r in rep["rows"]) == 2
    # A broadcast from rank 2: every algorithm, the tree built from the measured links.
    proc = _plait(["topology", "--local", "3", "--coll", "broadcast", "--root", "2", "--bench", "--sizes", "64K",
                   "--iters", "1", "--json", "-"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert (rep["collective"], rep["root"]) == ("broadcast", 2)
    assert [r["algorithm"] for r in rep["rows"]] == plait._core.algorithms("broadcast")
    tree = next(r for r in rep["rows"] if r["algorithm"] == "tree")
    assert tree["schedule"].startswith("tree (edges ") and tree["measured_s"] > 0, tree
    proc = _plait(["topology", "--local", "2", "--sizes", "1M"], no_rich=tmp_path / "norich")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ring order 0 > 1" in proc.stdout and "predicted" in proc.stdout and "measured / predicted" not in proc.stdout
    proc = _plait(["topology", "--sizes", "1M"], timeout=60)
    assert proc.returncode == 2 and "RANK" in proc.stderr and "--local 3" in proc.stderr, proc.stderr


def test_topology_fits_the_cost_model_and_its_setting_gives_the_fitted_predictions(tmp_path):
    """`plait topology --local 2 --fit`: the constants fitted to the measured runs come with the
    PLAIT_COST_MODEL text that uses them; a new world given that text predicts what the fit said
    it would (the setting carries the fit whole), and a malformed one is refused in words."""
    env = dict(os.environ, PLAIT_MEASURE="0", COLUMNS="120")
    cmd = CLI + ["topology", "--local", "2", "--fit", "--sizes", "4K,1M", "--iters", "2", "--json", "-"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    fit = rep["fit"]
    assert fit["setting"].startswith("alpha=") and "parallelism=" in fit["setting"], fit
    assert fit["error_after"] <= fit["error_before"] and len(fit["after"]) == len(rep["rows"]), fit
    env["PLAIT_COST_MODEL"] = fit["setting"]
    proc = subprocess.run(CLI + ["topology", "--local", "2", "--sizes", "4K,1M", "--json", "-"], capture_output=True,
                          text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads(proc.stdout)
    assert again["cost_model"] == fit["setting"]
    for old, new in zip(rep["rows"], again["rows"]):
        assert new["predicted_s"] == pytest.approx(old["fitted_s"], rel=2e-3), (old, new)
    env["PLAIT_COST_MODEL"] = "alpha=fast"
    t0 = time.monotonic()
    proc = subprocess.run(CLI + ["topology", "--local", "2", "--sizes", "4K"], capture_output=True, text=True,
                          timeout=180, env=env)
    assert proc.returncode != 0 and "PLAIT_COST_MODEL" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60, "every rank fails at once, none waits out the timeout on the store"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the testbed is Linux-only")
def test_testbed_status_json_to_stdout_or_a_file(tmp_path):
    proc = _plait(["testbed", "status", "--json", "-"], timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    beds = json.loads(proc.stdout)
    assert isinstance(beds, list)
    path = tmp_path / "beds.json"
    proc = _plait(["testbed", "status", "--json", str(path)], timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(path.read_text()) == beds


def test_tools_without_rich_print_plain_text(tmp_path):
    proc = _plait(["doctor", "--local", "2", "--no-bandwidth"], no_rich=tmp_path / "norich")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for text in ("Interfaces", "Routes", "127.0.0.1 -> 127.0.0.1", "Round trip", "no problems found", "ring order 0 > 1"):
        assert text in proc.stdout, proc.stdout
    assert not BOX & set(proc.stdout) and "\x1b" not in proc.stdout and "[bold" not in proc.stdout, proc.stdout
    proc = _plait(["--help"], no_rich=tmp_path / "norich", timeout=60)
    assert proc.returncode == 0 and "bench" in proc.stdout, proc.stderr


def test_bench_json_to_stdout_without_rich(tmp_path):
    pytest.importorskip("torch")
    args = ["bench", "--backend", "plait,gloo", "-b", "8", "-e", "64", "-f", "8", "-n", "2", "-w", "0", "--nproc", "2",
            "--timeout", "120"]
    proc = _plait(args + ["--json", "-"], no_rich=tmp_path / "norich", timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout)  # the whole of stdout: no table
    assert data["backends"] == ["plait", "gloo"] and {r["size"] for r in data["results"]} == {8, 64}
    assert all(r["wrong"] == 0 for r in data["results"]), data
    # With a file: the tables, in plain text, and the file.
    path = tmp_path / "bench.json"
    proc = _plait(args + ["--json", str(path)], no_rich=tmp_path / "norich", timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratios against gloo" in proc.stdout and not BOX & set(proc.stdout), proc.stdout
    assert json.loads(path.read_text())["backends"] == ["plait", "gloo"]


def test_demo_json_to_stdout_without_rich(tmp_path):
    """`pip install plait` without extras gets no rich: the demo still runs, in plain text. With
    `--json -` its summary is all of stdout; progress and the verdict go to stderr."""
    pytest.importorskip("torch")  # the demo's ranks meet through torch's TCPStore
    proc = _plait(["demo", "--quick", "--no-mesh", "--json", "-"], no_rich=tmp_path / "norich", timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["failed"] == 0 and len(summary["collectives"]) >= 14 and summary["sweep"]
    assert "all checks passed" in proc.stderr and "\x1b" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("command", [["demo"], ["bench"], ["doctor"], ["testbed", "status"], ["trace", "show"]])
def test_every_command_takes_json_path_or_dash(command):
    """One `--json` everywhere: an optional PATH, `-` (or nothing) meaning stdout."""
    proc = _plait(command + ["--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--json [PATH]" in text and "`--json -` (or --json alone)" in text, proc.stdout
