"""DiLoCo against DDP: the same model, data and number of inner steps, on local elastic members.

    python examples/diloco_train.py                       # 4 members; DDP, then DiLoCo H=50/100, f32/int8
    python examples/diloco_train.py --plot diloco.png     # also draws loss against step and bytes (matplotlib)

Each configuration starts MEMBERS processes on this machine that form an elastic group
(`plait.elastic.join`) and train the same small language model for STEPS inner steps with AdamW.
The text is synthetic (no download): token sequences drawn from a fixed random second-order
Markov chain over 32 tokens; the model (an embedding of the last 3 tokens and an MLP) predicts the
next token, and each member draws its own sequences. Its loss is a cross-entropy with a known
floor: the chain's own entropy, which no model can beat; the table also gives each loss's excess
over that floor.

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

VOCAB, CONTEXT, EMBED, HIDDEN = 32, 3, 32, 256
SEQUENCE = 16  # predictions per drawn sequence


def _chain():
    """The next token's distribution after each pair of tokens: a fixed random second-order chain."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    return torch.softmax(2.0 * torch.randn(VOCAB, VOCAB, VOCAB, generator=gen), -1)


def _draw(chain, sequences, length, gen):
    import torch

    seq = torch.empty(sequences, length, dtype=torch.long)
    seq[:, :2] = torch.randint(0, VOCAB, (sequences, 2), generator=gen)
    for t in range(2, length):
        seq[:, t] = torch.multinomial(chain[seq[:, t - 2], seq[:, t - 1]], 1, generator=gen).squeeze(1)
    windows = seq.unfold(1, CONTEXT + 1, 1).reshape(-1, CONTEXT + 1)
    return windows[:, :CONTEXT], windows[:, CONTEXT]


def model_and_data(seed_member, batch):
    """The model (the same initial weights on every member), this member's batches, the validation
    set and the loss floor on it (the chain's entropy at each of its positions, averaged)."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, EMBED), nn.Flatten(), nn.Linear(CONTEXT * EMBED, HIDDEN), nn.GELU(),
                          nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, VOCAB))
    chain = _chain()
    gen = torch.Generator().manual_seed(100 + seed_member)

    def next_batch():
        x, y = _draw(chain, -(-batch // SEQUENCE), SEQUENCE + CONTEXT, gen)
        return x[:batch], y[:batch]

    vx, vy = _draw(chain, 256, 40, torch.Generator().manual_seed(999))
    p = chain[vx[:, -2], vx[:, -1]]
    floor = -(p * p.log()).sum(-1).mean().item()
    return model, next_batch, (vx, vy), floor


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
    model, next_batch, (vx, vy), floor = model_and_data(comm.rank, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
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
        if diloco is not None:
            diloco.update()  # the update point: it communicates at the start of each round only
        elif step % eval_every == 1 or eval_every == 1:
            comm.update()
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
                          "params": n_params, "seconds": seconds, "members": comm.world_size, "floor": floor}),
              flush=True)
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
    floor = results[0].get("floor")
    for ax in (left, right):
        if floor is not None:
            ax.axhline(floor, color="grey", linestyle="--", linewidth=1, label="floor (the chain's entropy)")
        ax.set_ylim(top=min(3.6, max(c[1] for r in results for c in r["curve"])))
    left.set(xlabel="inner step", ylabel="validation loss (nats)", title="loss against step")
    right.set(xlabel="MiB sent per member (payload)", ylabel="validation loss (nats)", xscale="log",
              title="loss against bytes sent")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64, help="per member and step")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's (DDP's optimizer, DiLoCo's inner one)")
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
        print(f"{config:>16}: final validation loss {r['final_loss']:.4f} (floor {r['floor']:.4f}), "
              f"{r['bytes'] / 2**20:9.2f} MiB sent per member, {r['seconds']:.1f} s", flush=True)
    base = next((r for r in results if r["config"] == "ddp"), None)
    if base:
        print(f"\nagainst ddp ({a.steps} steps, {a.members} members, {base['params']} parameters):")
        excess = base["final_loss"] - base["floor"]
        for r in results:
            if r is not base:
                print(f"{r['config']:>16}: loss {100 * (r['final_loss'] / base['final_loss'] - 1):+6.1f} %, "
                      f"excess over the floor {100 * ((r['final_loss'] - r['floor']) / excess - 1):+6.1f} %, "
                      f"{base['bytes'] / max(r['bytes'], 1):7.1f}x fewer bytes")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    sys.exit(main())
