"""DiLoCo under churn (`plait testbed churn --workload diloco`), briefly: four members train with
plait.diloco.DiLoCo while the driver kills members, the leader among them and some inside an outer
average, and joiners take their places mid-run; every survivor must end at the same inner step
with a bit-identical outer state."""

import signal
import time

import pytest

import harness
from plait.tools.testbed.churn import DilocoSettings, run_churn

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="kills members with signals")


def test_diloco_under_kills_and_joins_every_survivor_ends_with_the_same_outer_state(tmp_path):
    start = time.time()
    report = run_churn(members=4, seconds=8, every=1.5, hb=1.0, seed=1, workdir=tmp_path,
                       kinds=("kill", "kill-leader", "kill-mid-average", "kill-leader-mid-average"),
                       diloco=DilocoSettings(every=5, pace=0.01))
    harness.note(f"diloco churn 8 s: {report.rounds} rounds, {report.survivors} survivors, {report.distinct_hashes} "
                 f"distinct final hash(es), {report.kills} kills ({report.mid_average_kills} inside an average), "
                 f"{report.joins} joins, longest stall {report.longest_stall_ms:.0f} ms, {time.time() - start:.1f} s wall")
    assert not report.errors, report.errors
    assert report.survivors >= 2
    assert report.distinct_hashes == 1, report.hashes
    assert report.final_worlds == [report.survivors] * report.survivors   # every survivor is in the one last view
    assert report.kills >= 3 and report.joins >= 3 + 3                    # the three first joiners, then replacements
    assert report.rounds >= 50 and report.inner_steps == report.end_step == 5 * report.rounds
