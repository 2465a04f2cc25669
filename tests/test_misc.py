"""`plait demo`, init_from_env with torch's TCPStore, the command line, and what `import plait` loads."""

import json
import os
import signal
import socket
import subprocess
import sys

import harness

SCRIPT = """
import numpy as np, plait
comm = plait.init_from_env(timeout=30)
y = comm.allreduce(np.full(4099, comm.rank + 1, np.float32))
assert (y == comm.world_size * (comm.world_size + 1) / 2).all(), y[:4]
g = comm.allgather(np.array([comm.rank], np.int64))
assert g.reshape(-1).tolist() == list(range(comm.world_size))
comm.close()
print("ok", comm.rank)
"""


def _run_all(cmds, envs, timeout):
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for c, e in zip(cmds, envs)]
    try:
        return [(p.communicate(timeout=timeout)[0].decode(errors="replace"), p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_init_from_env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = 3
    envs = [dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n))
            for r in range(n)]
    results = _run_all([[sys.executable, "-c", SCRIPT]] * n, envs, timeout=90)
    for r, (out, code) in enumerate(results):
        assert code == 0 and f"ok {r}" in out, f"rank {r} exit {code}:\n{out[-3000:]}"


def test_debug_log_of_a_clean_run_has_no_warning_and_no_colour(tmp_path):
    """PLAIT_DEBUG logs to stderr; a job that closes cleanly logs no WARN (closing is not a
    failure), and stderr redirected to a file gets plain text, no ANSI colour codes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = 3
    procs = []
    for r in range(n):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                   PLAIT_DEBUG="info")
        with open(tmp_path / f"{r}.log", "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.DEVNULL,
                                          stderr=log, start_new_session=True))
    try:
        codes = [p.wait(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for r in range(n):
        text = (tmp_path / f"{r}.log").read_text(errors="replace")
        assert codes[r] == 0, f"rank {r} exit {codes[r]}:\n{text[-3000:]}"
        if r == 0:  # rank 0 logs the topology and routes at INFO: the log is on
            assert " INFO plait_core" in text, text[-3000:]
        assert "\x1b" not in text, text[-3000:]
        warned = [line for line in text.splitlines() if " WARN " in line or " ERROR " in line]
        assert not warned, warned


def test_demo(tmp_path):
    path = tmp_path / "demo.json"
    ((out, code),) = _run_all([[sys.executable, "-m", "plait.tools.cli", "demo", "--quick", "--json", str(path)]],
                              [dict(os.environ, COLUMNS="120")], timeout=150)
    assert code == 0, out[-5000:]
    for text in ("Every collective once", "allreduce sweep", "raw single TCP stream", "all checks passed"):
        assert text in out, out[-5000:]
    summary = json.loads(path.read_text())
    assert summary["failed"] == 0 and len(summary["collectives"]) >= 14 and summary["sweep"]
    best = max(s["busbw_GBps"] for s in summary["sweep"])
    harness.note(f"plait demo --quick: best allreduce busbw {best:.2f} GB/s (3 ranks); plait send/recv "
                 f"{summary['p2p']['GBps']:.2f} GB/s; raw single TCP stream {summary['raw_tcp']['GBps']:.2f} GB/s")


def test_cli():
    out = subprocess.run([sys.executable, "-m", "plait.tools.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("plait ")
    out = subprocess.run([sys.executable, "-m", "plait.tools.cli", "demo", "--nproc", "1"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "at least 2" in out.stderr


def test_console_script_names_the_cli():
    """pyproject's `plait` script must point at the command line wherever it lives."""
    import importlib
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    target = re.search(r'^\[project\.scripts\]\s*\nplait = "([\w.]+):(\w+)"', text, re.M)
    assert target, "no `plait = \"module:function\"` under [project.scripts]"
    assert callable(getattr(importlib.import_module(target[1]), target[2]))


def test_import_plait_loads_only_the_library():
    """The tools (plait.tools), rich and torch stay out of `import plait`, and numpy (the direct
    API's) until the direct API is used: a training job pays only for what it uses."""
    code = ("import json, sys, plait; before = sorted(sys.modules); plait.Communicator; "
            "print(json.dumps([before, sorted(sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    mods, after = json.loads(out.stdout)
    heavy = [m for m in mods if m.split(".")[0] in ("torch", "rich", "numpy") or m.startswith("plait.tools")]
    assert not heavy, heavy
    assert "numpy" in after and "plait.comm" in after


def test_public_api_is_typed_and_rich_is_optional():
    """py.typed ships in the package (maturin takes every file of python/plait), the public API
    has annotations, and rich is an extra (the torch extra has it: `pip install -e '.[torch]' &&
    plait demo` shows the tables), not a dependency of the library."""
    import inspect
    import re
    from pathlib import Path

    import plait

    assert (Path(plait.__file__).parent / "py.typed").is_file()
    for name in plait.__all__:
        assert getattr(plait, name) is not None, name
    for fn in (plait.init_from_env, plait.Communicator.allreduce, plait.Communicator.subgroup, plait.Work.wait,
               plait.supported_dtypes):
        sig = inspect.signature(fn)
        assert sig.return_annotation is not inspect.Signature.empty, fn
        assert all(p.annotation is not inspect.Parameter.empty for p in sig.parameters.values()
                   if p.name != "self"), (fn, sig)
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*)\]", text, re.M)[1]
    assert "rich" not in deps, deps
    for extra in ("tools", "torch", "test"):
        assert re.search(rf'^{extra} = \[.*"rich"', text, re.M), extra
