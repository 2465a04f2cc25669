"""DiLoCo against DDP: the same model, data and number of inner steps, on local elastic members.

    python examples/diloco_train.py                       # 4 members; DDP, then DiLoCo H=50/100, f32/int8
    python examples/diloco_train.py --plot diloco.png     # also draws loss against step and bytes (matplotlib)

Each configuration starts MEMBERS processes on this machine that form an elastic group
(`plait.elastic.join`) and train the same MLP (a regression on a fixed random teacher network;
each member draws its own batches) for STEPS inner steps with AdamW:

- `ddp`: gradients averaged every step (`GradientAverager`);
- `diloco-H-WIRE`: `plait.diloco.DiLoCo` with H inner steps per round, the outer average in f32 or
  int8 (with error feedback), outer SGD lr 0.7, Nesterov momentum 0.9.

Every EVAL steps the most senior member evaluates the shared model (for DiLoCo, the outer
parameters) on a fixed validation set. Bytes are the payload each member contributed to averages
(the wire encoding included), the same measure for both. The table and `--json` give the final
validation loss and the bytes; `--plot` draws both curves.
"""

import argparse
import json
import os
import subprocess
import sys
import time

D_IN, HIDDEN, D_OUT = 32, 256, 8


def model_and_data(seed_member, batch):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)  # the same initial weights on every member
    model = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D_OUT))
    teacher_gen = torch.Generator().manual_seed(1234)
    w1 = torch.randn(D_IN, 64, generator=teacher_gen) / D_IN ** 0.5
    w2 = torch.randn(64, D_OUT, generator=teacher_gen) / 8

    def teacher(x):
        return torch.tanh(x @ w1) @ w2

    gen = torch.Generator().manual_seed(100 + seed_member)

    def next_batch():
        x = torch.randn(batch, D_IN, generator=gen)
        return x, teacher(x) + 0.01 * torch.randn(batch, D_OUT, generator=gen)

    vgen = torch.Generator().manual_seed(999)
    vx = torch.randn(2048, D_IN, generator=vgen)
    return model, next_batch, (vx, teacher(vx))


def member(config, steps, batch, lr, eval_every, members, outer_lr, outer_momentum):
    import torch

    import plait.elastic
    from plait import _core
    from plait.diloco import DiLoCo
    from plait.torch.elastic import GradientAverager

    comm = plait.elastic.join(listen="127.0.0.1:0", timeout=120)
    print(json.dumps({"contact": comm.contact}), flush=True)
    comm.update()  # a joiner's first update() is the members' update point that admitted it
    while comm.world_size < members:
        time.sleep(0.01)
        comm.update()
    model, next_batch, (vx, vy) = model_and_data(comm.rank, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = torch.nn.MSELoss()
    n_params = sum(p.numel() for p in model.parameters())
    if config == "ddp":
        avg, diloco, every = GradientAverager(comm, model), None, eval_every
    else:
        _, h, wire = config.split("-")
        diloco = DiLoCo(model, opt, comm, every=int(h), wire=wire, outer_lr=outer_lr, outer_momentum=outer_momentum)
        every = int(h)

    def validation():
        with torch.no_grad():
            if diloco is None:
                return loss_fn(model(vx), vy).item()
            saved = diloco.local.clone()
            diloco.local.copy_(diloco.outer)
            loss = loss_fn(model(vx), vy).item()
            diloco.local.copy_(saved)
            return loss

    curve = [(0, validation(), 0)]
    ddp_bytes = 0
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        if step % every == 1 or every == 1:  # the update point: once per round (DDP: as often as it evaluates)
            if diloco is None:
                comm.update()
            else:
                diloco.update()
        x, y = next_batch()
        loss_fn(model(x), y).backward()
        if diloco is None:
            avg.step(opt)
            ddp_bytes += _core.wire_bytes("native", n_params)
        else:
            diloco.step()
            diloco.zero_grad()
        if step % eval_every == 0:
            curve.append((step, validation(), ddp_bytes if diloco is None else diloco.bytes_sent))
    seconds = time.perf_counter() - t0
    if comm.rank == 0:
        print(json.dumps({"config": config, "curve": curve, "final_loss": curve[-1][1], "bytes": curve[-1][2],
                          "params": n_params, "seconds": seconds, "members": comm.world_size}), flush=True)
    comm.barrier()
    comm.close()


def run_config(config, a):
    env = dict(os.environ)
    env.pop("PLAIT_JOIN", None)
    env.pop("PLAIT_JOIN_STORE", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--member", config, "--steps", str(a.steps), "--batch", str(a.batch),
           "--lr", str(a.lr), "--eval-every", str(a.eval_every), "--members", str(a.members),
           "--outer-lr", str(a.outer_lr), "--outer-momentum", str(a.outer_momentum)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)]
    try:
        contact = json.loads(procs[0].stdout.readline())["contact"]
        procs += [subprocess.Popen(cmd, env=dict(env, PLAIT_JOIN=contact), stdout=subprocess.PIPE, text=True)
                  for _ in range(a.members - 1)]
        result = None
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"{config}: a member exited {p.returncode}")
            for line in out.splitlines():
                if line.startswith("{") and '"config"' in line:
                    result = json.loads(line)
        return result
    finally:
        for p in procs:
            p.kill()


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = [c[0] for c in r["curve"]]
        losses = [c[1] for c in r["curve"]]
        left.plot(steps, losses, label=r["config"])
        sent = [(c[2] / 2**20, c[1]) for c in r["curve"] if c[2] > 0]  # from the first average on
        right.plot([b for b, _ in sent], [l for _, l in sent], label=r["config"])
    left.set(xlabel="inner step", ylabel="validation loss", yscale="log", title="loss against step")
    right.set(xlabel="MiB sent per member (payload)", ylabel="validation loss", xscale="log", yscale="log",
              title="loss against bytes sent")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64, help="per member and step")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's (DDP's optimizer, DiLoCo's inner one)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD learning rate")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer Nesterov momentum")
    ap.add_argument("--configs", default="ddp,diloco-50-f32,diloco-50-int8,diloco-100-f32,diloco-100-int8")
    ap.add_argument("--json", help="write the results (curves included) to this file")
    ap.add_argument("--plot", help="draw the curves into this image (needs matplotlib)")
    ap.add_argument("--replot", help="only draw --plot from the results of an earlier --json")
    ap.add_argument("--member", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.replot:
        with open(a.replot) as f:
            return plot(json.load(f), a.plot)
    if a.member:
        return member(a.member, a.steps, a.batch, a.lr, a.eval_every, a.members, a.outer_lr, a.outer_momentum)
    results = []
    for config in a.configs.split(","):
        r = run_config(config, a)
        results.append(r)
        print(f"{config:>16}: final validation loss {r['final_loss']:.5f}, {r['bytes'] / 2**20:9.2f} MiB sent per member, "
              f"{r['seconds']:.1f} s", flush=True)
    base = next((r for r in results if r["config"] == "ddp"), None)
    if base:
        print(f"\nagainst ddp ({a.steps} steps, {a.members} members, {base['params']} parameters):")
        for r in results:
            if r is not base:
                print(f"{r['config']:>16}: loss {100 * (r['final_loss'] / base['final_loss'] - 1):+6.1f} %, "
                      f"{base['bytes'] / max(r['bytes'], 1):7.1f}x fewer bytes")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    sys.exit(main())
