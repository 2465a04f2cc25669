"""What a joiner costs DiLoCo's members: two members train, a third joins mid-run.

    python examples/diloco_join.py                      # 16 M parameters (a 192 MB outer state), H=20
    python examples/diloco_join.py --params 4194304 --every 10 --steps 100 --join-at 40

The members train a stand-in model (one parameter vector of --params floats, a quadratic loss,
plain SGD, a short sleep per step for the rest of a real step's work). When the first member ends
round --join-at, a joiner starts (the members go on past --steps until it is in). For each of the first member's rounds the table gives its wall
time and the time it spent inside DiLoCo's calls (`update()` and `step()`: the averages, and any
wait for a catch-up); the joiner's line gives how long its download of the outer state took. With
plait's DiLoCo the members send the state from a background thread and keep training: the round
in which the joiner came in should cost them no more time inside DiLoCo than other rounds.
"""

import argparse
import json
import subprocess
import sys
import time


def member(n, total, every, contact):
    import torch

    import plait.elastic
    from plait.diloco import DiLoCo

    w = torch.nn.Parameter(torch.zeros(n))
    model = torch.nn.Module()
    model.w = w
    inner = torch.optim.SGD(model.parameters(), lr=0.01)  # before join(): the first optimizer is slow to build
    comm = plait.elastic.join([contact] if contact else None, listen="127.0.0.1:0", timeout=120)
    print(json.dumps({"contact": comm.contact}), flush=True)
    diloco = DiLoCo(model, inner, comm, every=every)
    target = torch.ones(n)
    t_join = t_round = time.perf_counter()
    first, inside = None, 0.0
    # The members go on until the joiner has come in (however long it takes to start) and trained
    # a round; every member's end is the same round boundary (the view, read after an update
    # point, is the same on every member).
    joined_at = None
    while joined_at is None or diloco.inner_steps < max(total, joined_at + 2 * every):
        t = time.perf_counter()
        diloco.update()
        inside += time.perf_counter() - t
        if joined_at is None and comm.world_size >= 3:
            joined_at = diloco.inner_steps
        if first is None:
            first = diloco.inner_steps
            if first > 0:
                print(json.dumps({"joiner_synced_s": time.perf_counter() - t_join, "at_step": first}), flush=True)
        if first == 0 and comm.world_size < 2:
            time.sleep(0.01)  # the first two start together
            continue
        (0.5 * ((w - target) ** 2).sum()).backward()
        time.sleep(0.01)
        before = diloco.inner_steps
        t = time.perf_counter()
        diloco.step()
        diloco.zero_grad()
        inside += time.perf_counter() - t
        if diloco.inner_steps // every != before // every:
            now = time.perf_counter()
            print(json.dumps({"round_end": diloco.inner_steps, "seconds": now - t_round, "inside_diloco_s": inside,
                              "members": comm.world_size}), flush=True)
            t_round, inside = now, 0.0
    diloco.finish()
    comm.barrier()
    comm.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=16 << 20)
    ap.add_argument("--every", type=int, default=20, help="H, inner steps per round")
    ap.add_argument("--steps", type=int, default=140)
    ap.add_argument("--join-at", type=int, default=60, help="the inner step after which the joiner starts")
    ap.add_argument("--member", nargs="?", const="", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.member is not None:
        return member(a.params, a.steps, a.every, a.member or None)
    cmd = [sys.executable, __file__, "--params", str(a.params), "--every", str(a.every), "--steps", str(a.steps), "--member"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    procs = [first]
    try:
        contact = json.loads(first.stdout.readline())["contact"]
        procs.append(subprocess.Popen(cmd + [contact], stdout=subprocess.PIPE, text=True))
        joiner = None
        print(f"{'round end':>9} {'members':>7} {'seconds':>8} {'inside DiLoCo (s)':>18}")
        for line in first.stdout:
            e = json.loads(line)
            print(f"{e['round_end']:>9} {e['members']:>7} {e['seconds']:>8.2f} {e['inside_diloco_s']:>18.3f}", flush=True)
            if e["round_end"] == a.join_at and joiner is None:
                joiner = subprocess.Popen(cmd + [contact], stdout=subprocess.PIPE, text=True)
                procs.append(joiner)
        for p in procs[1:]:
            out, _ = p.communicate(timeout=600)
            for line in out.splitlines():
                e = json.loads(line)
                if "joiner_synced_s" in e:
                    print(f"joiner: admitted at inner step {e['at_step']}, outer state received in "
                          f"{e['joiner_synced_s']:.2f} s (from join() to the end of its sync)")
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("a member failed")
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
