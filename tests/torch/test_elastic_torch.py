"""The elastic training-loop helper: members that join get the group's weights, gradients are
averaged over whoever is present, and every member's parameters stay identical, through a joiner
and through a member that crashes."""

import json
import os
import subprocess
import sys

_WORKER = r"""
import hashlib, json, os, sys, torch
import plait, plait.elastic
from plait.torch.elastic import GradientAverager

want, crash_after = int(sys.argv[1]), int(sys.argv[2])
comm = plait.elastic.join(listen="127.0.0.1:0", heartbeat_timeout=0.5, timeout=30)
print(json.dumps({"contact": comm.contact}), flush=True)
torch.manual_seed(int(comm.member_id, 16) % 1000)        # every member starts from other weights
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
avg = GradientAverager(comm, model)
steps = committed = 0
gen = torch.Generator().manual_seed(int(comm.member_id, 16) % 997)
while steps < 40:
    if comm.update():
        avg.sync_parameters()
    if comm.world_size < want and steps == 0:
        continue                                          # wait for everyone before counting
    x = torch.randn(32, 8, generator=gen)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    loss.backward()
    committed += avg.step(opt)
    steps += 1
    if steps == crash_after:
        os._exit(0)                                       # a crash: no goodbye
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(json.dumps({"digest": digest, "committed": committed, "world": comm.world_size, "loss": float(loss)}), flush=True)
comm.barrier()
comm.close()
"""


def test_members_train_to_identical_weights_through_a_join_and_a_crash():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    founder = subprocess.Popen([sys.executable, "-c", _WORKER, "3", "0"], env=env, stdout=subprocess.PIPE, text=True)
    contact = json.loads(founder.stdout.readline())["contact"]
    others = [subprocess.Popen([sys.executable, "-c", _WORKER, "3", str(crash)], env=dict(env, PLAIT_JOIN=contact),
                               stdout=subprocess.PIPE, text=True) for crash in (0, 15)]
    results = []
    for p in [founder, others[0]]:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        results.append(json.loads(out.strip().splitlines()[-1]))
    others[1].communicate(timeout=60)
    assert results[0]["digest"] == results[1]["digest"], "the survivors' weights differ"
    assert results[0]["world"] == 2, "the crashed member was left out"
    assert results[0]["committed"] >= 30, results
