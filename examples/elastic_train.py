"""Training over whoever is present: an elastic plait group as torch's default group, DDP over it.

    plait run --listen 0.0.0.0:29400 examples/elastic_train.py     # the first machine
    plait run --join HOST:29400 examples/elastic_train.py          # any other, at any time
    # or the same command everywhere, with a directory started once by `plait store --listen 0.0.0.0:29500`:
    plait run --store HOST:29500 examples/elastic_train.py

Kill any member (the first one too) or start another mid-run: the others go on. Each step, every
member trains on its slice of the step's global batch (cut by the current rank and world size),
DDP averages the gradients over the members present, and a step during which a member was lost
is dropped on every member alike (`should_commit`). The weights, AdamW's state and the step number
are one shared state (`TrainingState`): a joiner downloads it, striped over the members, at the
update point that admits it, so every member's weights stay bit-identical. Rank 0 prints the loss averaged over
the members; at the end every member prints a digest of its weights (the same on all). torch
warns once that DDP's find_unused_parameters found no unused parameter: plait's DDP sets it so
that every member's buckets keep one layout (docs/elastic.md, "The torch process group").
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import plait
import plait.torch.elastic as pe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import TinyNet, global_batch, local_slice  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=96, help="global batch (split across the members present)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.01, help="AdamW's")
    ap.add_argument("--min-members", type=int, default=1, help="wait for this many members before the first step")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (time to kill members by hand)")
    a = ap.parse_args()

    pg = pe.init_process_group()
    torch.manual_seed(int(pg.elastic.member_id, 16) % 10007)  # each member starts from other weights
    model = pe.DistributedDataParallel(TinyNet(hidden=a.hidden))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    loss_fn = nn.MSELoss()
    step = torch.zeros(1, dtype=torch.int64)  # the group's step number: a joiner takes it with the weights
    state = pe.TrainingState(model, opt, step=step)
    state.sync(pg)
    while dist.get_world_size() < a.min_members:
        if pg.update():
            state.sync(pg)
        time.sleep(0.05)
    committed = 0
    while int(step) < a.steps:
        if pg.update():  # joiners come in here; rank and world size may move
            state.sync(pg)
            print(f"[member {pg.elastic.member_id}] epoch {pg.epoch}: rank {dist.get_rank()} of {dist.get_world_size()}",
                  flush=True)
        t0 = time.perf_counter()
        rank, world = dist.get_rank(), dist.get_world_size()
        x, y = global_batch(int(step), a.batch)
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        if pg.should_commit():
            opt.step()
            committed += 1
        opt.zero_grad()
        report = loss.detach().clone()
        try:
            dist.all_reduce(report, op=dist.ReduceOp.AVG)
            if dist.get_rank() == 0:
                print(f"step {int(step):4d}  members {dist.get_world_size()}  loss {report.item():.6f}  "
                      f"{(time.perf_counter() - t0) * 1000:7.2f} ms", flush=True)
        except plait.PeerLost:
            pass  # a member was lost: the next step runs over the new view
        step += 1
        if a.step_delay:
            time.sleep(a.step_delay)
    digest = state.digest()[:16]  # the weights, AdamW's state and the step number
    print(json.dumps({"member": pg.elastic.member_id, "committed": committed, "digest": digest}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
