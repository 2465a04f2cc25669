"""Elastic mode across a network partition: five members, each in its own network namespace of a
testbed; the cables between a random two and the other three are cut for 3 s at a time (with
kills in between). The side with a majority goes on during the cut, the other side is left out
and learns so after the heal, and no member ever returns a wrong result."""

import harness
from plait.tools.testbed.churn import run_churn


def test_the_majority_side_of_a_partition_goes_on_and_no_result_is_wrong(tmp_path):
    report = run_churn(members=5, seconds=25, every=2, hb=0.5, kinds=("partition", "kill"), seed=2,
                       workdir=tmp_path, netns=True, partition_seconds=3.0)
    d = report.as_dict()
    harness.note(f"elastic partition 3|2 (netns), 25 s: {report.committed} committed, {report.wrong} wrong, "
                 f"{report.partitions} partitions, {report.kills} kills; cut to the majority side's next commit "
                 f"p50 {d.get('partition_p50_ms') or 0:.0f} ms")
    assert report.wrong == 0
    assert not report.errors, report.errors
    assert report.partitions >= 2
    # The majority side commits while the cut lasts (3 s), after one heartbeat timeout or so (on
    # a loaded machine a cut can come right at a view change: most, not all, are measured).
    cuts = report.recovery_ms["partition"]
    assert sum(ms < 3000 for ms in cuts) >= len(cuts) / 2, report.recovery_ms
