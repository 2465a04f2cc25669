"""Cases known before they run, so that pytest reports each by name.

A cases module lists its cases as generators of Case(name, group, run). The worker runs them in
order and reports every case by name (pass or fail); the parent builds the same list at collection
time, from the same generators and world size, and gives each group its own test id. The list
cannot drift: the worker never names a case itself, and a case it never reported (its section
aborted, its rank died) fails too.

Why groups (section x dtype x op, e.g. `allreduce-f32-sum`: its sizes, in and out of place)
rather than one id per case: a collectives run has ~17,000 rank-independent cases, and pytest
spends about 1 ms on each item; per group that is ~2,200 items. A failing group names each of
its failing cases and ranks in its message."""

import os
from collections import namedtuple

# name: what the worker reports and failures show; group: the test id part; run(ctx): None when
# the case passed, else what is wrong (never called by the parent).
Case = namedtuple("Case", "name group run")


def selected(sections, only=None):
    """The (name, cases) sections PLAIT_TEST_SECTIONS names (`only` when given), all if unset:
    the worker and the parent filter the same way."""
    only = os.environ.get("PLAIT_TEST_SECTIONS") if only is None else only
    return [(name, cases) for name, cases in sections if not only or name in only.split(",")]


def groups(cases):
    """{group: [case names]} in run order. Names must be unique: results are keyed by them."""
    out, seen = {}, set()
    for case in cases:
        if case.name in seen:
            raise ValueError(f"two cases named {case.name!r}")
        seen.add(case.name)
        out.setdefault(case.group, []).append(case.name)
    return out


class Batch:
    """Cases that run together (operations outstanding at once): the first case to run does the
    work for all of them, each then reads its own problem by key."""

    def __init__(self, fn):
        self.fn, self.problems = fn, None

    def problem(self, key, ctx):
        if self.problems is None:
            self.problems = self.fn(ctx)
        return self.problems[key]
