"""plait as torchft's process group (`plait.torch.torchft.ProcessGroupPlait`): configured by
torchft's protocol (a store address per quorum, then rank and world size), reconfigured when the
quorum changes, its collectives right each time."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torchft")

_WORKER = r"""
import sys, torch
from datetime import timedelta
import torch.distributed as dist
from plait.torch.torchft import ProcessGroupPlait

port, quorums = int(sys.argv[1]), sys.argv[2:]
pg = ProcessGroupPlait(timeout=timedelta(seconds=30))
for q in quorums:                                   # "id:rank:world"
    qid, rank, world = (int(x) for x in q.split(":"))
    pg.configure(f"127.0.0.1:{port}/quorum/{qid}", "replica", rank, world, quorum_id=qid)
    t = torch.full((1000,), float(rank + 1))
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    assert torch.all(t == world * (world + 1) / 2), (q, t[0])
    print("ok", q, pg.getBackendName(), flush=True)
pg.shutdown()
"""


def test_torchft_configures_and_reconfigures_a_plait_group():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # Quorum 1: replicas a and b; quorum 2: c joins (a torchft quorum change).
    plans = {"a": ["1:0:2", "2:0:3"], "b": ["1:1:2", "2:1:3"], "c": ["2:2:3"]}
    procs = {k: subprocess.Popen([sys.executable, "-c", _WORKER, str(store.port), *v], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, v in plans.items()}
    for k, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        assert out.count("ok ") == len(plans[k]) and "torchft-plait" in out, out
