"""`plait bench` as a user runs it: a small sweep through torch.distributed for plait and gloo in
one run, with results checked and written as JSON."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_bench_sweeps_both_backends_and_checks_results(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "plait.tools.cli", "bench", "--backend", "plait,gloo", "-b", "8", "-e", "64K",
           "-f", "64", "-n", "3", "-w", "1", "--nproc", "2", "--json", str(out), "--timeout", "120"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["backends"] == ["plait", "gloo"]
    rows = data["results"]
    assert {(r["backend"], r["size"]) for r in rows} == {(b, s) for b in ("plait", "gloo") for s in (8, 512, 32768)}
    for r in rows:
        assert r["wrong"] == 0, r
        assert 0 < r["time_p50_us"] <= r["time_p99_us"], r
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # allreduce at 2 ranks: factor 1
    assert all(r["algorithm"] != "-" for r in rows if r["backend"] == "plait")
    assert "ratios against gloo" in proc.stdout


def test_bench_rejects_a_bad_size():
    proc = subprocess.run([sys.executable, "-m", "plait.tools.cli", "bench", "-b", "lots"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "not a size" in proc.stderr
