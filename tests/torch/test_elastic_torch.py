"""The elastic training-loop helper: members that join get the group's weights, gradients are
averaged over whoever is present, and every member's parameters stay identical, through a joiner
and through a member that crashes."""

import json
import os
import subprocess
import sys

import harness

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


def _survivors(worker, args, timeout=120, late_args=()):
    """The last JSON line of each member that ran to its end (a member that crashed on purpose
    printed none)."""
    return [lines[-1] for lines in harness.elastic_group(worker, args, late=late_args, timeout=timeout) if lines]


def test_members_train_to_identical_weights_through_a_join_and_a_crash():
    results = _survivors(_WORKER, [["3", "0"], ["3", "0"], ["3", "15"]])
    assert results[0]["digest"] == results[1]["digest"], "the survivors' weights differ"
    assert results[0]["world"] == 2, "the crashed member was left out"
    assert results[0]["committed"] >= 30, results


_DIST_WORKER = r"""
import hashlib, json, os, sys, torch
import torch.distributed as dist
import plait
import plait.torch.elastic as pe

want, crash_after = int(sys.argv[1]), int(sys.argv[2])
pg = pe.init_process_group(listen="127.0.0.1:0", heartbeat_timeout=0.5, timeout=30)
print(json.dumps({"contact": pg.elastic.contact}), flush=True)
while dist.get_world_size() < want:
    pg.update()
worlds = {dist.get_world_size()}
checked = 0
torch.manual_seed(int(pg.elastic.member_id, 16) % 1000)        # every member starts from other weights
model = pe.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
model.sync_parameters()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(int(pg.elastic.member_id, 16) % 997)
committed = 0
for step in range(30):
    if pg.update():
        model.sync_parameters()
    # a plain dist call on the default group: every member adds its rank + 1
    while True:
        epoch, world, rank = pg.epoch, dist.get_world_size(), dist.get_rank()
        t = torch.full((3,), float(rank + 1))
        try:
            dist.all_reduce(t)
            break
        except plait.PeerLost:
            assert (t == rank + 1).all(), "a failed all_reduce left its buffer changed"
    if pg.epoch == epoch:
        assert (t == world * (world + 1) / 2).all(), (t, world)
        checked += 1
    worlds.add(dist.get_world_size())
    x = torch.randn(32, 8, generator=gen)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    loss.backward()
    if model.should_commit():
        opt.step()
        committed += 1
    opt.zero_grad()
    if step + 1 == crash_after:
        os._exit(0)                                              # a crash: no goodbye
try:
    dist.send(torch.zeros(1), dst=(dist.get_rank() + 1) % dist.get_world_size())
    refused = ""
except Exception as e:
    refused = str(e)
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(json.dumps({"digest": digest, "committed": committed, "checked": checked, "worlds": sorted(worlds),
                  "refused": refused}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_torch_default_group_follows_the_view_and_ddp_keeps_weights_identical_through_a_join_and_a_crash():
    results = _survivors(_DIST_WORKER, [["3", "0"], ["3", "0"], ["3", "12"]])
    assert results[0]["digest"] == results[1]["digest"], "the survivors' weights differ"
    for r in results:
        assert r["worlds"] == [2, 3], r                  # dist.get_world_size() followed the views
        assert r["checked"] >= 20 and r["committed"] >= 20, r
        assert "not offered in elastic mode" in r["refused"], r


_COALESCED_WORKER = r"""
import json, os, sys, torch
import torch.distributed as dist
import plait
import plait.torch.elastic as pe

quitter = sys.argv[1] == "quit"
pg = pe.init_process_group(listen="127.0.0.1:0", heartbeat_timeout=0.5, timeout=30)
print(json.dumps({"contact": pg.elastic.contact}), flush=True)
while dist.get_world_size() < 3:
    pg.update()
a = torch.full((1000,), float(dist.get_rank() + 1))
if quitter:
    dist.all_reduce(a)          # pairs with the first part of the others' call only
    os._exit(0)
b = torch.full((7,), float(dist.get_rank() + 1), dtype=torch.float64)
before = (a.clone(), b.clone())
lost = 0
while True:
    try:
        pg.allreduce_coalesced([a, b], dist.AllreduceCoalescedOptions()).wait()  # two core operations: f32, then f64
        break
    except plait.PeerLost:
        lost += 1
        assert torch.equal(a, before[0]) and torch.equal(b, before[1]), "a failed call left a part of it done"
        a, b = torch.full((1000,), float(dist.get_rank() + 1)), torch.full((7,), float(dist.get_rank() + 1), dtype=torch.float64)
world = dist.get_world_size()
dist.barrier()                  # the other survivor may not leave (and shrink the view) before world is read
print(json.dumps({"lost": lost, "a": a[0].item(), "b": b[0].item(), "world": world}), flush=True)
dist.destroy_process_group()
"""


def test_a_call_of_several_operations_that_loses_a_member_is_undone_as_a_whole():
    results = _survivors(_COALESCED_WORKER, [["stay"], ["stay"], ["quit"]], timeout=60)
    for r in results:
        assert r["lost"] == 1 and r["world"] == 2, r
        assert r["a"] == 3.0 and r["b"] == 3.0, r    # ranks 0 and 1 of the two survivors: 1 + 2


def test_the_elastic_default_group_alone_and_what_it_refuses():
    code = r"""
import torch, torch.distributed as dist
import plait.torch.elastic as pe
pg = pe.init_process_group(listen="127.0.0.1:0", timeout=10)
assert dist.get_rank() == 0 and dist.get_world_size() == 1 and dist.get_backend() == "plait-elastic"
t = torch.arange(5.0)
w = dist.all_reduce(t, async_op=True)
assert w.is_completed() and w.wait() and torch.equal(t, torch.arange(5.0))
try:
    pe.init_process_group(listen="127.0.0.1:0", timeout=10)
    raise SystemExit("a second default group was accepted")
except RuntimeError as e:
    assert "exists already" in str(e), e
try:
    dist.new_group([0])
    raise SystemExit("new_group was accepted")
except Exception as e:
    assert "elastic" in str(e), e
dist.destroy_process_group()
try:
    pg.elastic.allreduce(torch.zeros(1).numpy())
    raise SystemExit("the member stayed in the group after destroy_process_group")
except Exception as e:
    pass
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    env.pop("PLAIT_JOIN_STORE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_the_elastic_example_trains_two_members_started_by_plait_run_to_the_same_weights():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "elastic_train.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PLAIT_JOIN", None)
    env.pop("PLAIT_JOIN_STORE", None)
    cli = [sys.executable, "-m", "plait.tools.cli", "run"]
    args = [example, "--steps", "30", "--min-members", "2", "--hidden", "64"]
    founder = subprocess.Popen(cli + ["--listen", f"127.0.0.1:{port}"] + args, env=env, stdout=subprocess.PIPE, text=True)
    joiner = subprocess.Popen(cli + ["--join", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0"] + args, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        outs = []
        for p in (founder, joiner):
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
            outs.append(out)
    finally:
        founder.kill()
        joiner.kill()
    finals = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert finals[0]["digest"] == finals[1]["digest"], finals
    assert all(f["committed"] == 30 for f in finals), finals
    assert "step   29  members 2" in outs[0], outs[0][-500:]


_ADAM_WORKER = r"""
import json, sys, time, torch
import torch.distributed as dist
import plait.torch.elastic as pe

pg = pe.init_process_group(listen="127.0.0.1:0", timeout=30)   # no crash here: the default heartbeat timeout
print(json.dumps({"contact": pg.elastic.contact}), flush=True)
torch.manual_seed(int(pg.elastic.member_id, 16) % 1000)        # every member starts from other weights
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.unused = torch.nn.Linear(4, 4)    # no gradient, so AdamW keeps no state for it on any member
    def forward(self, x):
        return self.body(x)
model = pe.DistributedDataParallel(Net())
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
step, end = torch.zeros(1, dtype=torch.int64), torch.full((1,), 1 << 30, dtype=torch.int64)
state = pe.TrainingState(model, opt, step=step, end=end)
gen = torch.Generator().manual_seed(int(pg.elastic.member_id, 16) % 997)
joined_at = None
while int(step) < int(end):
    if pg.update():
        if dist.get_world_size() == 3 and int(end) == 1 << 30:
            end[0] = int(step) + 20            # the members' value wins the sync below: the joiner's does not vote
        state.sync(pg)
    joined_at = int(step) if joined_at is None else joined_at
    if dist.get_world_size() < 2:
        continue                               # the first two start together
    x = torch.randn(32, 8, generator=gen)
    ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
    if model.should_commit():
        opt.step()
    opt.zero_grad()
    step += 1
    if int(step) == 5:
        opt.param_groups[0]["lr"] = 0.005      # as a scheduler would: a joiner must get it too
    time.sleep(0.02)                           # the joiner arrives mid-run
print(json.dumps({"digest": state.digest(), "joined_at": joined_at, "world": dist.get_world_size(), "lr": opt.param_groups[0]["lr"],
                  "adam_steps": sorted({int(v["step"]) for v in opt.state.values()})}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_joiner_gets_the_weights_and_adams_state_so_every_member_stays_bit_identical():
    results = _survivors(_ADAM_WORKER, [[], []], late_args=[[]])
    assert len(results) == 3 and all(r["world"] == 3 for r in results), results
    assert sorted(r["joined_at"] for r in results)[:2] == [0, 0] and max(r["joined_at"] for r in results) > 0, results
    assert len({r["digest"] for r in results}) == 1, "the weights or the optimizer state differ"
    assert len({tuple(r["adam_steps"]) for r in results}) == 1, results   # the joiner's AdamW counts from the members' step
    assert all(r["lr"] == 0.005 for r in results), results
