"""PyTorch's own DistributedTest suite against a torch.distributed backend (plait by default).

    python tests/torch/run_conformance.py                     # CI subset "world3" (plait, WORLD_SIZE 3)
    python tests/torch/run_conformance.py --subset groups8    # subgroup tests (WORLD_SIZE 8)
    python tests/torch/run_conformance.py --subset as_gloo3   # gloo-gated tests, plait underneath
    python tests/torch/run_conformance.py --full              # every test
    python tests/torch/run_conformance.py --backend gloo --full
    python tests/torch/run_conformance.py --as-gloo --full    # as if BACKEND were gloo, plait underneath
    python tests/torch/run_conformance.py -k test_all_reduce  # unittest -k patterns

Each test spawns WORLD_SIZE fresh processes; tests gated on BACKEND == "gloo"/"nccl" skip
themselves. This file is re-imported by the spawned children, so the environment is set up at
import time.
"""

import json
import os
import re
import sys

os.environ.setdefault("BACKEND", "plait")
os.environ.setdefault("WORLD_SIZE", "3")
os.environ.setdefault("TEMP_DIR", "/tmp")
os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")

if os.environ["BACKEND"] == "plait" or os.environ.get("PLAIT_AS_GLOO") == "1":
    import plait.torch  # noqa: F401  registers the backend (children re-import this module)

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

# "ddp" and "subgroup" gate most tests; "gpu" and "plugin" gate a few CPU tests (object
# collectives, DDP bucket caps...) that gloo runs on CPU. The same sets are used for every backend.
for _feature in ("ddp", "subgroup", "gpu", "plugin"):
    DistTestCases.backend_feature[_feature].add(os.environ["BACKEND"])

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


def _plait_as_gloo():
    """--as-gloo: the suite believes it runs gloo (so gloo-gated tests run) while every group is
    made by plait's creator."""
    import torch.distributed as dist

    from plait.torch.backend import create

    dist.Backend._plugins["GLOO"] = dist.Backend._BackendPlugin(create, True)


_PRELOAD = ["torch", "torch.distributed", "torch.testing._internal.distributed.distributed_test"]
if os.environ["BACKEND"] == "plait" or os.environ.get("PLAIT_AS_GLOO") == "1":
    _PRELOAD.append("plait.torch")


class TestConformance(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("CONFORMANCE_START", "forkserver") == "spawn":
            self._spawn_processes()
        else:
            # A fork server that has imported torch once: each test's WORLD_SIZE processes start
            # in milliseconds instead of re-importing torch (seconds each on a small machine).
            import multiprocessing

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            # Children of the fork server inherit *its* environment, not this test's (TEMP_DIR
            # and INIT_METHOD change per test): hand it over through a file next to the
            # rendezvous file.
            with open(self.file_name + ".env.json", "w") as f:
                json.dump(dict(os.environ), f)
            self._start_processes(ctx.Process)

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name + ".env.json")
        except OSError:
            pass

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        try:
            with open(file_name + ".env.json") as f:
                env = json.load(f)
        except OSError:
            env = None
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if os.environ.get("PLAIT_AS_GLOO") == "1":
            _plait_as_gloo()
        super()._run(rank, test_name, file_name, pipe, **kwargs)


# Tests the suite runs on CPU only for MPI (all_to_all, all_to_all_single: gloo lacks them in the
# suite's eyes). Their bodies apply to any backend that has the collective: each gets a copy named
# <test>_mpi_gated that runs it (the group tests still skip below WORLD_SIZE 8, as for MPI).
MPI_GATED = ("Only MPI supports CPU all_to_all_single", "Only MPI supports all_to_all")


def _add_mpi_gated_copies(cls):
    for name in dir(DistributedTest._DistTestBase):
        fn = getattr(DistributedTest._DistTestBase, name)
        if name.startswith("test_") and getattr(fn, "__unittest_skip_why__", None) in MPI_GATED:
            def copy(self, _fn=fn):
                return _fn(self)
            copy.__name__ = name + "_mpi_gated"
            setattr(cls, copy.__name__, copy)


if os.environ["BACKEND"] != "mpi":
    _add_mpi_gated_copies(TestConformance)


# Why a test of the suite is skipped here, by the reason the suite gives; every skip must match
# one of these (test_torch_conformance.py checks it), so a new kind of skip is seen and judged.
SKIP_REASONS = [
    (r"accelerator|Need at least \d+ accelerator|CUDA|[Nn][Cc][Cc][Ll]|high priority stream",
     "needs GPUs or NCCL (none on a CPU machine; gloo skips them too)"),
    (r"small world size|world size of \d+|exact world size",
     "needs another WORLD_SIZE (the *_group tests run in the groups8 subset)"),
    (r"Only MPI supports",
     "named for MPI; each runs as its <test>_mpi_gated copy"),
    (r"one of \{'gloo'\}|get_future is only supported|Only gloo backend supports timeouts|GLOO Batch Send Recv"
     r"|Only Gloo backend supports sparse|Only Nccl & Gloo backend",
     "named for gloo by the suite; run with --as-gloo (subsets as_gloo3, as_gloo_full2)"),
    (r"pytorch/pytorch/(issues|pull)/\d+|internal test flaky",
     "disabled by PyTorch itself for every backend"),
    (r"no torchvision", "needs torchvision (not a dependency)"),
    (r"Requires file:// initialization",
     "needs INIT_METHOD=file:// (the runner uses env://, as torchrun does)"),
]


def skip_reason(why):
    """The entry of SKIP_REASONS that explains a skip, or None."""
    for pattern, reason in SKIP_REASONS:
        if re.search(pattern, why):
            return reason
    return None


# Tests that fail under --as-gloo for a reason that is about the suite believing it runs gloo.
AS_GLOO_KNOWN = {
    "test_ddp_logging_data_cpu": "compares DDP's logged backend_name (the group's getBackendName(), 'plait') "
                                 "with dist.get_backend(), which --as-gloo makes 'gloo'",
}


# CI subsets. "world3": every test this suite runs on CPU at WORLD_SIZE 3 (every collective in
# its sync, async, complex and profiled forms, p2p, object collectives, DDP). "groups8": the
# subgroup tests, which this torch skips below WORLD_SIZE 8. "as_gloo3": tests the suite gates on
# BACKEND == "gloo" (get_future, all_reduce_coalesced, batch_isend_irecv, monitored_barrier,
# scatter_object_list, DDP no_sync with hooks), run with --as-gloo.
SUBSETS = {
    "world3": dict(world_size="3", as_gloo=False, tests="""
        test_Backend_enum_class test_DistributedDataParallelCPU test_DistributedDataParallelCPU_grad_is_view
        test_DistributedDataParallel_requires_grad test_all_gather test_all_gather_coalesced_complex
        test_all_gather_coalesced_full_group test_all_gather_coalesced_simple test_all_gather_coalesced_with_empty
        test_all_gather_complex test_all_gather_full_group test_all_gather_object_default_pg
        test_all_gather_object_subgroup test_all_reduce_coalesced_max_complex_unsupported
        test_all_reduce_complex_unsupported_ops test_all_reduce_full_group_max test_all_reduce_full_group_min
        test_all_reduce_full_group_product test_all_reduce_full_group_sum test_all_reduce_max test_all_reduce_min
        test_all_reduce_product test_all_reduce_sum test_all_reduce_sum_async test_all_reduce_sum_complex
        test_barrier test_barrier_full_group test_broadcast test_broadcast_full_group test_ddp_create_graph
        test_ddp_logging_data_cpu test_destroy_full_group test_destroy_group test_dump_DDP_relevant_env_vars
        test_gather test_gather_checks test_gather_full_group test_get_backend test_get_rank
        test_get_rank_size_full_group test_get_rank_size_group test_irecv test_isend test_isend_autograd_profiler
        test_isend_torch_profiler test_reduce_full_group_max test_reduce_full_group_min
        test_reduce_full_group_product test_reduce_full_group_sum test_reduce_max test_reduce_min
        test_reduce_product test_reduce_sum test_reduce_sum_twice test_scatter test_scatter_checks
        test_scatter_complex test_scatter_full_group test_send_recv test_send_recv_any_source
        test_send_recv_any_source_autograd_profiler test_send_recv_any_source_torch_profiler
        test_send_recv_autograd_profiler test_send_recv_torch_profiler test_send_recv_with_tag
        test_send_recv_with_tag_autograd_profiler test_send_recv_with_tag_torch_profiler test_static_graph_api_cpu
    """),
    "groups8": dict(world_size="8", as_gloo=False, tests="""
        test_all_gather_coalesced_group test_all_gather_group test_all_reduce_group_max test_all_reduce_group_min
        test_all_reduce_group_product test_all_reduce_group_sum test_barrier_group test_broadcast_group
        test_gather_group test_reduce_group_max test_reduce_group_min test_reduce_group_product
        test_reduce_group_sum test_scatter_group test_all_reduce_full_group_sum test_destroy_group
        test_get_rank_size_group
    """),
    # Every test of the suite at WORLD_SIZE 2, by name (skips must have a reason in SKIP_REASONS),
    # and again with the suite believing it runs gloo.
    "full2": dict(world_size="2", as_gloo=False, tests=None),
    "as_gloo_full2": dict(world_size="2", as_gloo=True, tests=None),
    "as_gloo3": dict(world_size="3", as_gloo=True, tests="""
        test_accumulate_gradients_no_sync test_accumulate_gradients_no_sync_allreduce_hook
        test_accumulate_gradients_no_sync_allreduce_with_then_hook test_accumulate_gradients_no_sync_grad_is_view
        test_all_reduce_coalesced_max test_all_reduce_coalesced_min test_all_reduce_coalesced_product
        test_all_reduce_coalesced_sum test_all_reduce_coalesced_full_group_sum test_batch_isend_irecv_gloo
        test_batch_isend_irecv_gloo_tags test_get_future test_grads_same_across_ranks_with_no_sync
        test_monitored_barrier_gloo test_monitored_barrier_gloo_subgroup test_scatter_object_list
    """),
}


def _failure_line(tb):
    """The line of a failed test's report that says what failed (the last `...Error: ...` line, not
    the suite's closing advice)."""
    lines = [ln.strip() for ln in tb.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|Failure)\b.*?: ", ln):
            return re.sub(r"^\[rank\d+\]:E\S+ \S+ \d+ \S+\] ", "", ln)
    return lines[-1] if lines else ""


def main(argv):
    import argparse
    import unittest

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--world-size", default=None)
    ap.add_argument("--full", action="store_true", help="run every test, not the CI subset")
    ap.add_argument("--subset", choices=sorted(SUBSETS), default=None,
                    help="a CI subset (sets the world size and --as-gloo itself)")
    ap.add_argument("-k", action="append", default=[], help="unittest -k pattern (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the selected test names and exit")
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--spawn", action="store_true", help="start each test's processes with spawn (slow)")
    ap.add_argument("--json", default=None, help="write per-test outcomes to this file")
    ap.add_argument("--as-gloo", action="store_true",
                    help="run the suite as if BACKEND were gloo (gloo-gated tests run) with plait making every group")
    a = ap.parse_args(argv)
    if a.subset:
        sub = SUBSETS[a.subset]
        want_as_gloo = "1" if sub["as_gloo"] else None
        if os.environ.get("WORLD_SIZE") != sub["world_size"] or os.environ.get("PLAIT_AS_GLOO") != want_as_gloo:
            env = dict(os.environ, WORLD_SIZE=sub["world_size"], BACKEND="gloo" if sub["as_gloo"] else "plait")
            env.pop("PLAIT_AS_GLOO", None)
            if sub["as_gloo"]:
                env["PLAIT_AS_GLOO"] = "1"
            os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + argv, env)
    if a.as_gloo and os.environ.get("PLAIT_AS_GLOO") != "1":
        env = dict(os.environ, BACKEND="gloo", PLAIT_AS_GLOO="1")
        if a.world_size:
            env["WORLD_SIZE"] = a.world_size
        args = [x for x in argv if x not in ("--world-size", a.world_size)]
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + args, env)
    if (a.backend or a.world_size) and not a.as_gloo:  # re-exec so that children see the environment at import
        env = dict(os.environ)
        if a.backend:
            env["BACKEND"] = a.backend
        if a.world_size:
            env["WORLD_SIZE"] = a.world_size
        args = [x for x in argv if x not in ("--backend", a.backend, "--world-size", a.world_size)]
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + args, env)
    if a.spawn:
        os.environ["CONFORMANCE_START"] = "spawn"
    loader = unittest.TestLoader()
    if a.k:
        loader.testNamePatterns = [p if "*" in p else f"*{p}*" for p in a.k]
    names = loader.getTestCaseNames(TestConformance)
    if not a.full and not a.k and SUBSETS[a.subset or "world3"]["tests"] is not None:
        wanted = SUBSETS[a.subset or "world3"]["tests"].split()
        present = set(names)
        missing = [n for n in wanted if n not in present]
        if missing:
            print(f"note: not in this torch's suite: {missing}", file=sys.stderr)
        names = [n for n in wanted if n in present]
    if a.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(TestConformance(n) for n in names)
    res = unittest.TextTestRunner(verbosity=2 if a.v else 1).run(suite)
    if a.json:
        outcome = {n: "passed" for n in names}
        for t, why in res.skipped:
            outcome[t._testMethodName] = "skipped: " + str(why)
        for t, tb in res.failures + res.errors:
            outcome[getattr(t, "_testMethodName", str(t))] = "failed: " + _failure_line(tb)[:400]
        with open(a.json, "w") as f:
            json.dump(outcome, f, indent=1, sort_keys=True)
    skipped = len(res.skipped)
    failed = len(res.failures) + len(res.errors)
    passed = res.testsRun - skipped - failed - len(res.expectedFailures) - len(res.unexpectedSuccesses)
    label = "plait (as gloo)" if os.environ.get("PLAIT_AS_GLOO") == "1" else os.environ["BACKEND"]
    print(f"\nbackend={label} world_size={os.environ['WORLD_SIZE']}: "
          f"{res.testsRun} run, {passed} passed, {skipped} skipped, {failed} failed")
    return 0 if res.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
