"""PyTorch's own DistributedTest suite against "plait": the CI subsets of run_conformance.py.

    world3    every test the suite runs on CPU at WORLD_SIZE 3 (collectives, p2p, DDP, profiler)
    groups8   the subgroup tests (this torch skips them below WORLD_SIZE 8)
    as_gloo3  tests the suite gates on BACKEND == "gloo", with plait making every group
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")

RUNNER = Path(__file__).resolve().parent / "run_conformance.py"


@pytest.mark.parametrize("subset", ["world3", "groups8", "as_gloo3"])
def test_conformance_subset(subset):
    p = subprocess.run([sys.executable, str(RUNNER), "--subset", subset], capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    m = re.search(r"(\d+) run, (\d+) passed, (\d+) skipped, (\d+) failed", out)
    assert m, out[-5000:]
    run, passed, skipped, failed = map(int, m.groups())
    assert failed == 0 and p.returncode == 0, out[-8000:]
    assert passed == run, f"{skipped} of the subset skipped: the suite changed?\n{out[-3000:]}"
