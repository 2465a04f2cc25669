"""Real clients, each run with plait and with gloo: the same script, the same results.

Every script under examples/clients/ (and the README's example, examples/ddp_train.py) is started
with torchrun on 2 or 3 CPU ranks, once with `--backend gloo` and once with `--backend plait`; rank 0
prints one RESULT line (per-step losses, the sum of the final parameters, whether every rank ended
in sync). The plait run must succeed and match gloo's: the losses and the checksum within float
tolerance (the same to the last bit when the reductions sum in the same order).

Clients: DDP (the README example), DDP's join context (uneven inputs), torch.compile(DDP), HF Accelerate, the transformers Trainer
(a tiny GPT-2 from a config, no download), Lightning's Trainer with DDPStrategy, Lightning Fabric,
and torchtitan-style code (DeviceMesh, FSDP2, tensor parallelism, a DCP checkpoint round trip).
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CLIENTS = EXAMPLES / "clients"


def torchrun(script, backend, nproc=2, args=(), timeout=600):
    """Run `script` under torchrun; return (exit status, output)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), "--backend", backend, *map(str, args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=str(ROOT))
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
        out, _ = p.communicate(timeout=60)
        raise subprocess.TimeoutExpired(cmd, timeout, output=out)
    return p.returncode, out


def _stop(p):
    """Stop a hung torchrun and its ranks (torchrun starts each rank in a session of its own)."""
    try:
        import psutil

        ranks = psutil.Process(p.pid).children(recursive=True)
    except Exception:
        ranks = []
    p.send_signal(signal.SIGTERM)  # torchrun stops its ranks, then exits
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
    for r in ranks:
        try:
            r.kill()
        except Exception:
            pass


def result(script, backend, nproc=2, args=(), timeout=600):
    try:
        rc, out = torchrun(script, backend, nproc, args, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.output or ""
        pytest.fail(f"{script.name} --backend {backend} {' '.join(map(str, args))}: no result after {timeout} s "
                    f"(hung?):\n{_tail(out)}")
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    for _ in range(2):
        if backend != "gloo" or rc == 0:
            break
        # The reference only: gloo sometimes aborts a rank at exit ("terminate called without an
        # active exception" after the RESULT line: seen in devicemesh_fsdp2_dcp.py and ddp_join.py
        # runs); run it again.
        rc, out = torchrun(script, backend, nproc, args, timeout=timeout)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    gloo_exit_abort = backend == "gloo" and len(lines) == 1 and "terminate called without an active exception" in out
    if gloo_exit_abort:
        # Three times in a row happened in CI under load: the reference's RESULT is complete (it
        # is printed after training), so it is used; plait's runs get no such leniency.
        rc = 0
    assert rc == 0 and len(lines) == 1, f"{script.name} --backend {backend} exited {rc}:\n{_tail(out)}"
    return json.loads(lines[0][len("RESULT "):])


def _tail(out, n=60):
    keep = [ln for ln in out.splitlines() if not ln.startswith(("W1", "I1", "USDT", "ERROR:"))]
    return "\n".join(keep[-n:])


def close(a, b, rel=1e-5, abs_=1e-6):
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=abs_) for x, y in zip(a, b))


def same_as_gloo(script, nproc=2, args=(), steps=None, timeout=600):
    gloo = result(script, "gloo", nproc, args, timeout)
    plait = result(script, "plait", nproc, args, timeout)
    assert plait["losses"] and (steps is None or len(plait["losses"]) == steps), plait
    assert all(map(math.isfinite, plait["losses"])), plait
    assert close(plait["losses"], gloo["losses"]), f"losses differ:\nplait {plait['losses']}\ngloo  {gloo['losses']}"
    assert close(plait["checksum"], gloo["checksum"]), f"parameters differ: plait {plait['checksum']} gloo {gloo['checksum']}"
    assert plait.get("in_sync", True), f"the ranks' parameters differ after training with plait: {plait}"
    assert plait.get("torch_backend", "plait") == "plait", plait
    return plait, gloo


def test_readme_example_ddp_train_matches_gloo():
    """The README's command, without --check (it used to die after step 0), on 3 ranks."""
    runs = {}
    for backend in ("gloo", "plait"):
        rc, out = torchrun(EXAMPLES / "ddp_train.py", backend, nproc=3, args=["--steps", "5"])
        for _ in range(2):  # the reference only: gloo sometimes aborts a rank at exit, see result()
            if backend != "gloo" or rc == 0:
                break
            rc, out = torchrun(EXAMPLES / "ddp_train.py", backend, nproc=3, args=["--steps", "5"])
        assert rc == 0, f"ddp_train.py --backend {backend} exited {rc}:\n{_tail(out)}"
        runs[backend] = [float(m) for m in re.findall(r"^step\s+\d+\s+loss ([0-9.eE+-]+)", out, re.M)]
    assert len(runs["plait"]) == 5, runs
    assert close(runs["plait"], runs["gloo"]), runs


def test_torch_compile_ddp_matches_gloo():
    """torch.compile(DDP(model)) with the default compiler (inductor): dynamo traces DDP and the
    backend's calls made while tracing."""
    same_as_gloo(CLIENTS / "compile_ddp.py", steps=6)


def test_accelerate_matches_gloo():
    pytest.importorskip("accelerate")
    plait, _ = same_as_gloo(CLIENTS / "accelerate_train.py", steps=6)
    assert plait["distributed_type"].endswith("MULTI_CPU"), plait


def test_hf_trainer_tiny_gpt2_matches_gloo():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    same_as_gloo(CLIENTS / "hf_trainer.py", steps=6)


def test_lightning_ddp_matches_gloo():
    pytest.importorskip("lightning")
    same_as_gloo(CLIENTS / "lightning_ddp.py", steps=6)


def test_fabric_matches_gloo():
    pytest.importorskip("lightning")
    same_as_gloo(CLIENTS / "fabric_train.py", steps=6)


@pytest.mark.parametrize("form", [[], ["--no-join"], ["--divide-by-current"]],
                         ids=["join", "join_disabled", "join_divide_by_current"])
def test_ddp_join_uneven_inputs_matches_gloo(form):
    """DDP's join context: uneven inputs (rank r trains r more steps), the disabled form, and
    divide_by_initial_world_size=False. A few seconds each with gloo: 120 s means hung."""
    same_as_gloo(CLIENTS / "ddp_join.py", args=form, steps=4, timeout=120)


@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp2", "fsdp2_tp"])
def test_devicemesh_fsdp2_dcp_matches_gloo(tp):
    plait, _ = same_as_gloo(CLIENTS / "devicemesh_fsdp2_dcp.py", args=["--tp", tp], steps=6)
    assert plait["dcp_roundtrip"], plait
    assert plait["mesh"] == [2 // tp, tp], plait
