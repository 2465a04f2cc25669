"""`plait schedule`: check, draw and price a schedule file (or a schedule program).

    plait schedule check FILE [--nranks 2,3,4]     verify (out of place and in place)
    plait schedule show FILE -o picture.svg        ranks as rows, steps as time, transfers as arrows
    plait schedule simulate FILE [--sizes ...]     the cost model's time per size, next to the built-ins
    plait schedule builtin COLL ALGO --nranks N    a built-in algorithm's schedule file, to start from

FILE is a version-1 schedule file (`.json`, docs/schedules.md) or a program (`.py` defining
`build(nranks)` that returns a `plait.schedule.Program`), which is compiled for every
`--nranks` given. A built-in algorithm is named `builtin:COLL:ALGO` (e.g. `builtin:allreduce:ring`).
"""

import argparse
import json
import os
import sys

from ._jsonout import add_json_option, to_stdout, write_json
from .topology import _show_size, parse_size

DEFAULT_SIZES = "4K,64K,1M,16M,64M"


def add_arguments(p):
    sub = p.add_subparsers(dest="schedule_command", metavar="action")
    chk = sub.add_parser("check", help="verify a schedule for each world size (out of place and in place)")
    _file_args(chk)
    add_json_option(chk)
    show = sub.add_parser("show", help="draw a schedule: ranks as rows, steps as time, arrows for transfers")
    _file_args(show)
    show.add_argument("-o", "--output", required=True, help="the picture: .svg, .png or .pdf (needs matplotlib)")
    comp = sub.add_parser("compile", help="write a program's schedule file (.json) for PLAIT_SCHEDULES, verified first")
    _file_args(comp)
    comp.add_argument("-o", "--output", default="-",
                      help="the file (default: stdout), or an existing directory, where each size is NAME-N.json")
    sim = sub.add_parser("simulate", help="the cost model's predicted time per size, next to the built-in algorithms")
    _file_args(sim)
    sim.add_argument("--sizes", default=DEFAULT_SIZES, help=f"call sizes, whole layout in bytes (default {DEFAULT_SIZES})")
    sim.add_argument("--topology", default="shared", choices=("shared", "full_mesh", "partial_mesh"),
                     help="shared: every rank's links share one interface (a switch, one host; default); "
                     "full_mesh: a cable per pair")
    sim.add_argument("--hosts", type=_positive, default=1,
                     help="ranks on this many hosts, as torchrun numbers them (NRANKS/HOSTS each): a host's ranks "
                     "talk through its memory and share its network interface to the others (default 1: the plain "
                     "model, where each rank's links are its own, as on one host or a host per rank)")
    sim.add_argument("--cost-model", default=None, metavar="NAME=VALUE,...",
                     help="cost-model constants as PLAIT_COST_MODEL takes them (default: that setting, else plait's)")
    add_json_option(sim)
    bn = sub.add_parser("bench", help="run it next to every built-in algorithm and gloo (plait bench on local ranks)",
                        description="Runs `plait bench --op COLL --nproc N --schedules FILE --backend "
                        "plait:NAME,plait:BUILTIN...,gloo` on this machine's loopback (or under torchrun / `plait "
                        "testbed run` on the real links): the schedule and each built-in forced in turn, gloo last.")
    _file_args(bn)
    bn.add_argument("-b", "--minbytes", default="4K", help="smallest size (default 4K; bench's -b)")
    bn.add_argument("-e", "--maxbytes", default="1M", help="largest size (default 1M)")
    bn.add_argument("-f", "--stepfactor", default="4", help="size multiplier (default 4)")
    bn.add_argument("-n", "--iters", default="200", help="timed iterations per size (default 200)")
    bn.add_argument("-w", "--warmup", default="20", help="untimed iterations per size (default 20)")
    bn.add_argument("--no-gloo", action="store_true", help="leave gloo out")
    add_json_option(bn)
    bi = sub.add_parser("builtin", help="write a built-in algorithm's schedule file (to read, or to start from)")
    bi.add_argument("collective")
    bi.add_argument("algorithm")
    bi.add_argument("--nranks", type=int, required=True)
    bi.add_argument("--root", type=int, default=0)
    bi.add_argument("--name", default=None, help="a new name: the file is then a custom schedule")
    bi.add_argument("-o", "--output", default="-", help="where to write it (default: stdout)")


def _positive(text):
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return v


def _file_args(p):
    p.add_argument("file", help="a schedule file (.json), a program (.py with build(nranks)), or builtin:COLL:ALGO")
    p.add_argument("--nranks", default=None,
                   help="world sizes to build a program (or a built-in) for, e.g. 2,3,4 (a .json file has its own)")
    p.add_argument("--root", type=int, default=0, help="root of a built-in rooted collective (default 0)")


def _sources(args):
    """[(text, origin, custom)] for every world size asked."""
    from .. import schedule as S

    sizes = [int(x) for x in args.nranks.split(",")] if args.nranks else None
    if args.file.startswith("builtin:"):
        parts = args.file.split(":")
        if len(parts) != 3:
            raise S.ScheduleError(f"{args.file}: write builtin:COLLECTIVE:ALGORITHM, e.g. builtin:allreduce:ring")
        if not sizes:
            raise S.ScheduleError(f"{args.file}: give --nranks")
        return [(S.builtin(parts[1], parts[2], n, args.root), f"{args.file} (nranks={n})", False) for n in sizes]
    if not os.path.exists(args.file):
        raise S.ScheduleError(f"{args.file}: no such file")
    if args.file.endswith(".py"):
        if not sizes:
            raise S.ScheduleError(f"{args.file}: a program needs --nranks (the world sizes to build it for)")
        return [S.load(args.file, n) + (True,) for n in sizes]
    text, origin = S.load(args.file)
    if sizes:
        n = json.loads(text).get("nranks")
        if n not in sizes:
            raise S.ScheduleError(f"{args.file} is for {n} ranks, not {args.nranks}")
    return [(text, origin, True)]


def main(args):
    from .. import _core
    from .. import schedule as S

    cmd = args.schedule_command
    if cmd is None:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        if cmd == "builtin":
            text = S.builtin(args.collective, args.algorithm, args.nranks, args.root, args.name)
            if args.output == "-":
                sys.stdout.write(text)
            else:
                with open(args.output, "w") as f:
                    f.write(text)
            return 0
        sources = _sources(args)
        if cmd == "check":
            return _check(sources, args)
        if cmd == "compile":
            return _compile(sources, args)
        if cmd == "show":
            return _show(sources, args)
        if cmd == "simulate":
            return _simulate(sources, args, _core)
        if cmd == "bench":
            return _bench(sources, args, _core)
    except (S.ScheduleError, _core.InvalidArgumentError, OSError) as e:
        print(f"plait schedule {cmd}: {e}", file=sys.stderr)
        return 1
    return 2


def _check(sources, args):
    from .. import schedule as S

    results, failed = [], 0
    for text, origin, custom in sources:
        try:
            facts = S.check(text, origin, custom)
            results.append({"origin": origin, "ok": True, **facts})
            if not to_stdout(args.json):
                print(f"ok  {origin}: {facts['collective']} '{facts['name']}' for {facts['nranks']} ranks, "
                      f"{facts['steps']} steps, {facts['transfers']} transfers, {facts['locals']} local operations, "
                      f"{facts['scratch_slots']} scratch slots (digest {facts['digest']})")
        except S.ScheduleError as e:
            failed += 1
            results.append({"origin": origin, "ok": False, "error": str(e)})
            print(f"FAIL {e}", file=sys.stderr if to_stdout(args.json) else sys.stdout)
    if args.json:
        write_json(args.json, {"results": results})
    return 1 if failed else 0


def _compile(sources, args):
    from .. import schedule as S

    into_dir = args.output != "-" and os.path.isdir(args.output)
    if len(sources) > 1 and not into_dir:
        raise S.ScheduleError(f"{len(sources)} world sizes make {len(sources)} files: give -o an existing directory")
    for text, origin, custom in sources:
        facts = S.check(text, origin, custom)
        if args.output == "-":
            sys.stdout.write(text)
            continue
        path = os.path.join(args.output, f"{facts['name']}-{facts['nranks']}.json") if into_dir else args.output
        with open(path, "w") as f:
            f.write(text)
        print(f"{path}: {facts['collective']} {facts['name']} for {facts['nranks']} ranks, {facts['steps']} steps, "
              f"digest {facts['digest']}", file=sys.stderr)
    return 0


def _show(sources, args):
    from .. import schedule as S

    if len(sources) != 1:
        raise S.ScheduleError("show draws one schedule: give one --nranks")
    text, origin, custom = sources[0]
    S.check(text, origin, custom)
    draw(json.loads(text), args.output)
    print(f"wrote {args.output}")
    return 0


def draw(doc, path):
    """Ranks as rows, steps as columns; an arrow per transfer (solid: copy, dashed: received and
    reduced), a dot per local operation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from .. import schedule as S

        raise S.ScheduleError("show needs matplotlib: pip install matplotlib") from None
    n, ranks = doc["nranks"], doc["ranks"]
    steps = max((len(p) for p in ranks), default=0)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * steps + 2), max(2.0, 0.7 * n + 1.2)))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def label(c):
        return f"{c['buf'][0]}{c['index']}"

    for r, prog in enumerate(ranks):
        for k, st in enumerate(prog):
            sends = st.get("sends", [])
            for i, s in enumerate(sends):
                q = s["peer"]
                # The executor pairs a step's transfers between two ranks in the order listed.
                ordinal = sum(1 for x in sends[:i] if x["peer"] == q)
                into = [x for x in ranks[q][k].get("recvs", []) if x["peer"] == r]
                dst = into[ordinal] if ordinal < len(into) else None
                reduces = dst is not None and dst.get("reduce_with") is not None
                color = colors[r % len(colors)]
                ax.annotate("", xy=(k + 0.85, q), xytext=(k + 0.15, r),
                            arrowprops=dict(arrowstyle="->", color=color, lw=1.2,
                                            linestyle="--" if reduces else "-", shrinkA=2, shrinkB=2))
                text = label(s["src"]) + ("" if dst is None else f"→{label(dst['dst'])}")
                ax.text(k + 0.5, (r + q) / 2, text, fontsize=7, ha="center", va="center", color=color,
                        bbox=dict(fc="white", ec="none", pad=0.3, alpha=0.8))
            for i, lo in enumerate(st.get("locals", [])):
                kind, body = next(iter(lo.items()))
                ax.plot([k + 0.9], [r], marker="o" if kind == "copy" else "s", color="black", ms=4)
                ax.text(k + 0.92, r + 0.18 + 0.14 * i, f"{kind} {label(body['src'])}→{label(body['dst'])}", fontsize=6)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_ylim(n - 0.5, -0.6)
    ax.set_xticks([k + 0.5 for k in range(steps)])
    ax.set_xticklabels([f"step {k}" for k in range(steps)], fontsize=8)
    ax.set_xlim(0, max(steps, 1))
    for k in range(steps + 1):
        ax.axvline(k, color="0.9", lw=0.8, zorder=0)
    ax.set_title(f"{doc['collective']} '{doc['name']}', {n} ranks\n"
                 "i/o/s: input/output/scratch chunk; dashed: received and reduced; dots: local operations", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _simulate(sources, args, core):
    from .. import schedule as S

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    cost_model = args.cost_model if args.cost_model is not None else core.setting("PLAIT_COST_MODEL")
    report = []
    for text, origin, custom in sources:
        facts = S.check(text, origin, custom)
        coll, n, root = facts["collective"], facts["nranks"], facts["root"]
        model = dict(topology=args.topology, hosts=args.hosts, cost_model=cost_model)
        rows = {facts["name"]: core.estimate_schedule(text, sizes, origin=origin, **model)}
        for algo in core.algorithms(coll):
            if algo == facts["name"]:
                continue
            rows[algo] = core.estimate_schedule(S.builtin(coll, algo, n, root), sizes, **model)
        report.append({"origin": origin, "collective": coll, "nranks": n, "topology": args.topology, "hosts": args.hosts,
                       "sizes": sizes, "predicted_seconds": rows})
        if not to_stdout(args.json):
            names = list(rows)
            on = f" on {args.hosts} hosts of {n // args.hosts} ranks" if args.hosts > 1 else ""
            print(f"{origin}: {coll} for {n} ranks{on}, predicted time (µs) on {args.topology} links")
            print("size".rjust(8) + "".join(nm[:14].rjust(15) for nm in names) + "   best")
            for i, size in enumerate(sizes):
                vals = [rows[nm][i] for nm in names]
                best = names[vals.index(min(vals))]
                print(_show_size(size).rjust(8) + "".join(f"{v * 1e6:15.1f}" for v in vals) + f"   {best}")
    if args.json:
        write_json(args.json, {"results": report})
    return 0


def _where(n):
    """bench's arguments for where the ranks run: under a launcher (torchrun, `plait testbed run`)
    this process is one of them, on the real links; otherwise bench starts n on loopback."""
    from .. import schedule as S
    from .bench import LAUNCHER_ENV

    missing = [k for k in LAUNCHER_ENV if k not in os.environ]
    if len(missing) == len(LAUNCHER_ENV):
        return ["--nproc", str(n)]
    if missing:
        have = ", ".join(k for k in LAUNCHER_ENV if k not in missing)
        raise S.ScheduleError(f"{have} set but not {', '.join(missing)}: under a launcher set all four, otherwise none")
    if os.environ["WORLD_SIZE"].strip() != str(n):
        raise S.ScheduleError(f"the launcher started {os.environ['WORLD_SIZE']} ranks (WORLD_SIZE) and the schedule "
                              f"is for {n}: launch {n}, or give --nranks {os.environ['WORLD_SIZE']}")
    return []


_BENCH_OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")


def _bench(sources, args, core):
    import subprocess
    import tempfile

    from .. import schedule as S

    if len(sources) != 1:
        raise S.ScheduleError("bench runs one world size: give one --nranks")
    text, origin, custom = sources[0]
    facts = S.check(text, origin, custom)
    coll, n, name = facts["collective"], facts["nranks"], facts["name"]
    if coll not in _BENCH_OPS:
        raise S.ScheduleError(f"plait bench has no {coll}: it runs {', '.join(_BENCH_OPS)}")
    if facts["root"] != 0:
        raise S.ScheduleError(f"plait bench roots {coll} at rank 0; this schedule's root is {facts['root']}")
    backends = [f"plait:{a}" for a in core.algorithms(coll) if a != name]
    with tempfile.TemporaryDirectory(prefix="plait-schedule-bench-") as tmp:
        if custom:
            path = os.path.join(tmp, f"{name}.json")
            with open(path, "w") as f:
                f.write(text)
            backends.insert(0, f"plait:{name}")
        if not args.no_gloo:
            backends.append("gloo")
        cmd = [sys.executable, "-m", "plait.tools.cli", "bench", "--op", coll] + _where(n) + [
               "--backend", ",".join(backends), "-b", args.minbytes, "-e", args.maxbytes, "-f", args.stepfactor,
               "-n", args.iters, "-w", args.warmup]
        if custom:
            cmd += ["--schedules", tmp]
        if args.json:
            cmd += ["--json", args.json]
        print("plait schedule bench: " + " ".join(cmd[3:]), file=sys.stderr, flush=True)
        return subprocess.call(cmd)
