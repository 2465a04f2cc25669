"""The `plait` command."""

import argparse
import signal
import sys

from ._jsonout import add_json_option


def _testbed_parsers(sub):
    tb = sub.add_parser("testbed", help="a direct-cabled mesh of network namespaces on this machine (root)",
                        description="N network namespaces with a rate-limited cable (its own /24) per pair and "
                        "a slower shared LAN. Needs root.")
    tsub = tb.add_subparsers(dest="tb_command", metavar="action")
    up = tsub.add_parser("up", help="build a testbed")
    up.add_argument("--nodes", type=int, required=True, help="number of nodes (2..16)")
    _common_build(up)
    down = tsub.add_parser("down", help="remove a testbed and everything it created")
    down.add_argument("--name", default="plaitbed")
    down.add_argument("--force", action="store_true",
                      help="also remove namespaces named like this testbed's when no state was recorded")
    run = tsub.add_parser("run", help="run a command once per node, or K times with --nproc-per-node K (RANK, "
                          "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set)",
                          description="Runs CMD once per node of a testbed that is up; with --nodes, builds a "
                          "testbed for this run and removes it afterwards.")
    run.add_argument("--nodes", type=int, help="build a testbed of this many nodes for this run only")
    _common_build(run)
    run.add_argument("--nproc-per-node", type=int, default=1, metavar="K",
                     help="processes per node, numbered as torchrun does: node i runs ranks i*K .. i*K+K-1, which "
                     "reach each other over the node's own loopback and the other nodes over its cables (default 1)")
    run.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is killed (default 600)")
    run.add_argument("--grace", type=float, default=10.0,
                     help="seconds the other ranks get after one fails, before they are killed (default 10)")
    run.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment variable")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    churn = tsub.add_parser("churn", help="elastic members on this machine under kills, stops and joins",
                            description="MEMBERS elastic members (processes on loopback) run allreduces on "
                            "deterministic inputs, each checking every result it returns, while every EVERY seconds "
                            "a random member is killed (-9), stopped (SIGSTOP, then SIGCONT) or the most senior one "
                            "killed, and joiners keep the group at MEMBERS. Reports operations committed, failed and "
                            "wrong (must be 0), and the time from each kill or stop to the next committed operation. "
                            "With --workload diloco the members train a small model with plait.diloco.DiLoCo instead "
                            "(H inner steps per round, one every --diloco-pace seconds); two more actions kill a member "
                            "inside an outer average (kill-mid-average, kill-leader-mid-average); after --seconds the "
                            "driver stops acting and sets an end step a few rounds ahead, where every member stops, "
                            "and the report gives the rounds, the survivors and their distinct final outer-state "
                            "hashes (must be 1), and errors. Example: plait testbed churn --workload diloco "
                            "--seconds 60 --seed 3")
    churn.add_argument("--members", type=int, default=4, help="group size to keep (default 4, at least 3)")
    churn.add_argument("--seconds", type=float, default=90.0, help="how long the chaos lasts (default 90)")
    churn.add_argument("--minutes", type=float, help="the same in minutes (a soak)")
    churn.add_argument("--every", type=float, default=1.5, help="seconds between actions (default 1.5)")
    churn.add_argument("--heartbeat-timeout", type=float, default=0.5,
                       help="the members' PLAIT_HEARTBEAT_TIMEOUT (default 0.5)")
    churn.add_argument("--actions", default=None,
                       help="comma-separated, among kill, stop, kill-leader, partition, and with --workload diloco "
                       "kill-mid-average, kill-leader-mid-average (default: all but partition; with --netns, all)")
    churn.add_argument("--netns", action="store_true",
                       help="each member in its own network namespace of a testbed (root), so that the network between "
                       "two halves of the group can be cut (the partition action)")
    churn.add_argument("--partition-seconds", type=float, default=3.0, help="how long a partition lasts (default 3)")
    churn.add_argument("--seed", type=int, default=0)
    churn.add_argument("--workload", choices=("allreduce", "diloco"), default="allreduce",
                       help="what the members run: checked allreduces (default), or DiLoCo training whose survivors "
                       "must end with bit-identical outer states (not with --netns)")
    churn.add_argument("--diloco-mode", choices=("sync", "async", "streaming"), default="sync",
                       help="DiLoCo's mode (default sync)")
    churn.add_argument("--diloco-every", type=int, default=5, help="H, inner steps per round (default 5)")
    churn.add_argument("--diloco-fragments", type=int, default=None,
                       help="streaming mode: fragments per round (default H)")
    churn.add_argument("--diloco-wire", default="int8", help="how averages travel: f32, bf16, f16, int8 (default int8)")
    churn.add_argument("--diloco-pace", type=float, default=0.01,
                       help="seconds each member sleeps after an inner step (default 0.01)")
    churn.add_argument("--diloco-steps", type=int, default=0,
                       help="train exactly this many inner steps (the chaos stops a few rounds before, or at "
                       "--seconds); default: end a few rounds after --seconds")
    add_json_option(churn)
    catchup = tsub.add_parser("catchup", help="a joiner's shared-state download time from 1, 2, 4... holders (root)",
                              description="For each number of holders H: H members on their own namespaces hold the "
                              "same shared state, each on its own rate-limited cable to a joiner, which joins and syncs "
                              "it (plait.elastic SharedState). Reports the joiner's sync time and receive rate.")
    catchup.add_argument("--holders", default="1,2,4", help="comma-separated holder counts (default 1,2,4)")
    catchup.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    catchup.add_argument("--link-rate", default="500mbit", help="every cable's tc rate (default 500mbit)")
    add_json_option(catchup)
    wc = tsub.add_parser("wan-check", help="measure the WAN cables of a testbed that is up: ping and TCP vs the spec",
                         description="For every WAN cable (--wan) of testbed NAME: the median round trip of ICMP "
                         "echoes, and a plain TCP stream each way (autotuned buffers, the first --warmup seconds left "
                         "out), next to the configured round trip and the TCP goodput the configured rate allows.")
    wc.add_argument("--name", default="plaitbed")
    wc.add_argument("--seconds", type=float, default=5.0, help="length of each TCP stream (default 5)")
    wc.add_argument("--warmup", type=float, default=2.0, help="seconds of each stream not counted (default 2)")
    wc.add_argument("--pings", type=int, default=20, help="ICMP echoes per cable (default 20)")
    wc.add_argument("--congestion", metavar="CC",
                    help="the streams' TCP congestion control, e.g. cubic (default: the nodes' default)")
    add_json_option(wc)
    status = tsub.add_parser("status", help="list the testbeds that are up and their addresses")
    add_json_option(status, help="write the testbeds as JSON to PATH; `--json -` (or --json alone) to stdout "
                    "instead of the table")
    return tb


def _common_build(p):
    p.add_argument("--name", default="plaitbed", help="namespaces are NAME-0, NAME-1, ... (default plaitbed)")
    p.add_argument("--link-rate", default="1gbit", help="rate of every cable, e.g. 1gbit, 10gbit, none (default 1gbit)")
    p.add_argument("--lan-rate", default="100mbit", help="rate of every LAN port (default 100mbit)")
    p.add_argument("--mtu", type=int, help="MTU of every cable end (default 1500)")
    p.add_argument("--mtu-end", action="append", default=[], metavar="I:J=MTU",
                   help="MTU of node I's end of the cable to node J only (repeatable), e.g. 0:1=9000 for a mismatch")
    p.add_argument("--links", metavar="I-J,...", help="cable only these pairs (default: every pair, a full mesh)")
    p.add_argument("--wan", metavar="SPEC",
                   help="give some cables a one-way delay, a rate and a loss rate per direction (a userspace delay "
                   "line: TUN ends and a forwarder per cable), e.g. \"0-1 40ms 200mbit, 1-2 5ms 1gbit, 0-2 80ms "
                   "50mbit loss=0.1%%\"; A/B values differ per direction (I->J/J->I), queue=2mb or 20ms sets the "
                   "router buffer (default one bandwidth-delay product); a cable without a rate gets --link-rate. "
                   "SPEC may also be a file (the same text, or JSON {\"0-1\": {\"delay\": \"40ms\", \"rate\": "
                   "\"200mbit\"}})")


def _build_kwargs(args):
    from .testbed import TestbedError

    ends = {}
    for spec in args.mtu_end:
        try:
            pair, mtu = spec.split("=")
            i, j = pair.split(":")
            ends[(int(i), int(j))] = int(mtu)
        except ValueError:
            raise TestbedError(f"--mtu-end {spec!r}: use I:J=MTU, e.g. 0:1=9000") from None
    links = None
    if args.links:
        try:
            links = [tuple(int(x) for x in p.split("-")) for p in args.links.split(",") if p.strip()]
        except ValueError:
            raise TestbedError(f"--links {args.links!r}: use pairs like 0-1,1-2") from None
    return dict(link_rate=args.link_rate, lan_rate=args.lan_rate, name=args.name, mtu=args.mtu, mtu_ends=ends,
                links=links, wan=args.wan)


def _serve_until_stopped():
    """Blocks while a server of this process (a witness, a store) serves, until Ctrl-C or SIGTERM."""
    import time

    _sigterm_as_exit()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _sigterm_as_exit():
    """So that `finally` blocks (testbed teardown, killing ranks) run on SIGTERM too."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    for name in ("SIGTERM", "SIGHUP"):  # Windows has no SIGHUP
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):
            pass


def _testbed(args, parser):
    from . import testbed as T
    from ._jsonout import to_stdout, write_json
    from ._ui import Console

    console = Console(stderr=True, highlight=False)
    if args.tb_command == "churn":
        return _churn(args, console)
    if args.tb_command == "catchup":
        return _catchup(args, console)
    why = T.not_linux()
    if why:
        console.print(f"[red]plait testbed: {why}")
        return 2
    _sigterm_as_exit()
    try:
        if args.tb_command == "up":
            tb = T.Testbed(args.nodes, **_build_kwargs(args))
            tb.up()
            tb._state = None  # stays up after this process exits
            _print_status([tb.describe()], console)
            console.print(f"run commands on it with `plait testbed run{_name_opt(args)} -- CMD`, remove it with "
                          f"`plait testbed down{_name_opt(args)}`")
            return 0
        if args.tb_command == "down":
            removed = T.down(args.name, force=args.force)
            console.print(f"removed {', '.join(removed)}" if removed else f"no testbed named {args.name!r} was up")
            return 0
        if args.tb_command == "wan-check":
            return _wan_check(args, console)
        if args.tb_command == "status":
            beds = T.list_testbeds()
            if args.json:
                write_json(args.json, beds)
            if to_stdout(args.json):
                return 0
            if beds:
                _print_status(beds, Console(highlight=False))
            else:
                console.print("no testbed is up")
            return 0
        if args.tb_command == "run":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("testbed run: give the command after --, e.g. plait testbed run -- plait doctor")
            if args.nproc_per_node < 1:
                parser.error("testbed run: --nproc-per-node must be at least 1")
            env = {}
            for kv in args.env:
                if "=" not in kv:
                    parser.error(f"--env {kv!r}: use K=V")
                k, v = kv.split("=", 1)
                env[k] = v
            if args.nodes:
                with T.Testbed(args.nodes, **_build_kwargs(args)) as tb:
                    res = tb.run(cmd, timeout=args.timeout, env=env, grace=args.grace, per_node=args.nproc_per_node)
            else:
                tb = T.Testbed.attach(args.name)
                res = tb.run(cmd, timeout=args.timeout, env=env, grace=args.grace, per_node=args.nproc_per_node)
            if not res.ok:
                bad = [f"rank {r}: {'killed' if c is not None and c < 0 else f'exit {c}'}"
                       for r, c in enumerate(res.returncodes) if c]
                console.print("[red]plait testbed run: " + ("timed out; " if res.timed_out else "")
                              + ", ".join(bad))
            return res.exit_code
        parser.parse_args(["testbed", "--help"])
        return 2
    except T.TestbedError as e:
        console.print(f"[red]plait testbed: {e}")
        return 2
    except KeyboardInterrupt:
        console.print("[red]plait testbed: interrupted")
        return 130


def _name_opt(args):
    return "" if args.name == "plaitbed" else f" --name {args.name}"


def _print_status(beds, console):
    from ._ui import Table
    from .testbed import format_rate

    for d in beds:
        t = Table(title=f"testbed {d['name']}: {d['nodes']} nodes, cables {format_rate(d['link_rate_bps'])}, LAN "
                  f"{format_rate(d['lan_rate_bps'])} ({d['lan_subnet']}), MASTER_ADDR {d['master_addr']}",
                  title_justify="left")
        for c in ("node", "namespace", "LAN (lan0)", "cables: interface address -> peer"):
            t.add_column(c)
        for node in d["node_list"]:
            cables = ", ".join(f"{c['iface']} {c['addr']} -> {c['peer']}" + (f" (mtu {c['mtu']})" if c["mtu"] != 1500
                                                                                  else "")
                               + (f" [WAN {c['wan']['text']}]" if c.get("wan") else "") for c in node["cables"])
            t.add_row(str(node["node"]), node["namespace"], node["lan"], cables)
        console.print(t)


def _wan_check(args, console):
    from . import testbed as T
    from ._jsonout import to_stdout, write_json
    from ._ui import Console, Table
    from .testbed import wan

    tb = T.Testbed.attach(args.name)
    if not tb.wan:
        console.print(f"[red]plait testbed wan-check: testbed {args.name!r} has no WAN cables (build it with --wan)")
        return 2
    results = []
    for i, j in sorted(tb.wan):
        console.print(f"measuring cable {i}-{j} ...")
        results.append(wan.check_cable(tb, i, j, pings=args.pings, seconds=args.seconds, warmup=args.warmup,
                                       congestion=args.congestion))
    if args.json:
        write_json(args.json, results)
    if to_stdout(args.json):
        return 0
    t = Table(title=f"WAN cables of testbed {args.name}: configured vs measured (Mbit/s: TCP payload; "
              "max: the rate less 52 B of headers per 1500 B packet)", title_justify="left")
    for c in ("cable", "RTT set", "RTT p50 (min)", "lost", "dir", "rate", "TCP max", "TCP", "ratio"):
        t.add_column(c)
    for r in results:
        for k, d in enumerate(r["directions"]):
            exp = d["goodput_bps_expected"]
            first = k == 0
            rtt = f"{r['rtt_ms_median']:.2f} ({r['rtt_ms_min']:.2f})" if r["rtt_ms_median"] is not None else "-"
            t.add_row(r["link"] if first else "", f"{r['rtt_ms_configured']:.2f}" if first else "",
                      rtt if first else "", str(r["pings_lost"]) if first else "", f"{d['from']}->{d['to']}",
                      T.format_rate(d["rate_bps"]), f"{exp / 1e6:.1f}" if exp else "-", f"{d['tcp_bps'] / 1e6:.1f}",
                      f"{d['tcp_bps'] / exp:.3f}" if exp else "-")
    Console(highlight=False).print(t)
    return 0


def _catchup(args, console):
    import tempfile
    from pathlib import Path

    from ._jsonout import to_stdout, write_json
    from .testbed import TestbedError, check_can_build
    from .testbed.catchup import run

    try:
        holders = [int(h) for h in args.holders.split(",") if h.strip()]
        if not holders or min(holders) < 1:
            raise ValueError
    except ValueError:
        console.print(f"[red]plait testbed catchup: --holders {args.holders!r}: use counts such as 1,2,4")
        return 2
    why = check_can_build()
    if why:
        console.print(f"[red]plait testbed catchup: {why}")
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="plait-catchup-") as d:
            results = run(holders, int(args.gib * 2**30), args.link_rate, Path(d),
                          progress=None if to_stdout(args.json) else console.print)
    except (TestbedError, RuntimeError) as e:
        console.print(f"[red]plait testbed catchup: {e}")
        return 1
    if args.json:
        write_json(args.json, {"runs": results})
    return 0


def _churn(args, console):
    from ._jsonout import to_stdout, write_json
    from .testbed.churn import DilocoSettings, run_churn

    if args.members < 3:
        console.print("[red]plait testbed churn: --members must be at least 3 (a majority must survive a loss)")
        return 2
    diloco = args.workload == "diloco"
    if diloco and args.netns:
        console.print("[red]plait testbed churn: --workload diloco does not run with --netns (no partitions): drop one")
        return 2
    known = ("kill", "stop", "kill-leader", "partition") + (("kill-mid-average", "kill-leader-mid-average") if diloco else ())
    default = "kill,stop,kill-leader,kill-mid-average,kill-leader-mid-average" if diloco else \
        ("kill,stop,kill-leader,partition" if args.netns else "kill,stop,kill-leader")
    kinds = tuple(k.strip() for k in (args.actions or default).split(",") if k.strip())
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        console.print(f"[red]plait testbed churn: unknown action(s) {bad}: use {', '.join(known)}"
                      + ("" if diloco else " (the mid-average kills need --workload diloco)"))
        return 2
    if "partition" in kinds and not args.netns:
        console.print("[red]plait testbed churn: a partition needs --netns (each member in its own namespace)"
                      + (", which --workload diloco does not support" if diloco else ""))
        return 2
    settings = None
    if diloco:
        every = args.diloco_every
        fragments = (args.diloco_fragments or every) if args.diloco_mode == "streaming" else 1
        if every < 1 or not 1 <= fragments <= every:
            console.print(f"[red]plait testbed churn: --diloco-every must be at least 1 and --diloco-fragments "
                          f"between 1 and it, got {every} and {fragments}")
            return 2
        settings = DilocoSettings(every=every, mode=args.diloco_mode, wire=args.diloco_wire, fragments=fragments,
                                  pace=args.diloco_pace, steps=args.diloco_steps)
    seconds = args.minutes * 60 if args.minutes else args.seconds
    _sigterm_as_exit()
    report = run_churn(members=args.members, seconds=seconds, every=args.every, hb=args.heartbeat_timeout,
                       kinds=kinds, seed=args.seed, progress=None if to_stdout(args.json) else console.print,
                       netns=args.netns, partition_seconds=args.partition_seconds, diloco=settings)
    d = report.as_dict()
    if args.json:
        write_json(args.json, d)
    if not to_stdout(args.json):
        if diloco:
            console.print(f"{seconds:.0f} s of chaos{' at most' if settings.steps else ''}, {args.members} members, DiLoCo {settings.mode} H={settings.every} "
                          f"{settings.wire}: {report.rounds} rounds ({report.inner_steps} inner steps, end step "
                          f"{report.end_step}); {report.survivors} survivors with {report.distinct_hashes} distinct final "
                          f"outer state(s), views {report.final_worlds}; {report.kills} kills ({report.mid_average_kills} "
                          f"inside an average), {report.stops} stops, {report.joins} joins, {report.evicted} evicted, "
                          f"{report.epochs} epochs; {len(report.errors)} errors")
            if report.first_loss is not None and report.probe_loss is not None:
                console.print(f"  loss: {report.first_loss:.3f} at the first round, {report.probe_loss:.4f} at the end "
                              "(the outer parameters, on a held-out batch)")
        else:
            console.print(f"{seconds:.0f} s, {args.members} members: {report.committed} operations committed, "
                          f"{report.failed} failed (PeerLost), {report.wrong} wrong; {report.kills} kills, "
                          f"{report.stops} stops, {report.partitions} partitions, {report.joins} joins, {report.epochs} epochs")
        unit = "round" if diloco else "committed operation"
        for kind in sorted(report.recovery_ms):
            console.print(f"  {kind}: to the next {unit} p50 {report.percentile(kind, 50):.0f} ms, "
                          f"p99 {report.percentile(kind, 99):.0f} ms ({len(report.recovery_ms[kind])} events)")
        if report.join_ms:
            console.print(f"  joins: admitted after p50 {d['join_p50_ms']:.0f} ms, p99 {d['join_p99_ms']:.0f} ms "
                          f"({len(report.join_ms)} joiners)")
        console.print(f"  longest stall {report.longest_stall_ms:.0f} ms" + (" (between rounds)" if diloco else ""))
        for e in report.errors[:5]:
            console.print(f"[red]  member error: {e}")
        if diloco and report.distinct_hashes != 1:
            console.print(f"[red]  the survivors' final outer states differ: {report.hashes}")
    if diloco:
        return 0 if report.distinct_hashes == 1 and not report.errors else 1
    return 0 if report.wrong == 0 and not report.errors else 1


def main(argv=None):
    parser = argparse.ArgumentParser(prog="plait", description="plait: collectives over TCP between ordinary machines")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="command")
    demo = sub.add_parser("demo", help="run every collective on a few local ranks, then an allreduce sweep")
    demo.add_argument("--nproc", type=int, default=3, help="number of local ranks (default 3, at least 2)")
    demo.add_argument("--quick", action="store_true", help="smaller sweep and reference transfer")
    add_json_option(demo)
    demo.add_argument("--no-mesh", action="store_true", help="skip the act on a mesh testbed (root only)")
    doctor = sub.add_parser("doctor", help="interfaces, routes, RTT and bandwidth between the ranks, and what is wrong",
                            description="Run once per rank like the job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                            "set), e.g. `plait testbed run -- plait doctor`, or `plait doctor --local 3`.")
    from .doctor import add_arguments

    add_arguments(doctor)
    topo = sub.add_parser("topology", help="the links as plait measures them, its ring order, and the cost model's "
                          "predictions (with --bench, next to measured times)",
                          description="Run once per rank like the job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), "
                          "e.g. `plait testbed run -- plait topology --bench`, or `plait topology --local 3`.")
    from .topology import add_arguments as topology_arguments

    topology_arguments(topo)
    bench = sub.add_parser("bench", help="nccl-tests-style sweep, plait next to other backends in one run",
                           description="Spawns --nproc local ranks on loopback (default 2), or, under torchrun or "
                           "`plait testbed run`, measures the real links. Example: plait bench --backend plait,gloo "
                           "-b 8 -e 128M -f 2")
    from .bench import build_parser as bench_arguments

    bench_arguments(bench)
    sched = sub.add_parser("schedule", help="check, draw and price custom collective algorithms (schedule files)",
                           description="Schedule files and programs: docs/schedules.md. Example: plait schedule check "
                           "examples/schedules/ring_allreduce.py --nranks 2,3,4")
    from .schedule import add_arguments as schedule_arguments

    schedule_arguments(sched)
    _testbed_parsers(sub)
    run = sub.add_parser("run", help="run a training script as a member of an elastic group",
                         description="Runs `python SCRIPT ARGS...` with PLAIT_JOIN and PLAIT_LISTEN set, so that "
                         "its plait.elastic.join() joins the group of the member at --join (or founds a group "
                         "without it). One command per machine; no launcher, no rendezvous server.")
    run.add_argument("--join", metavar="HOST:PORT", action="append", default=[],
                     help="a member's control address (repeatable); omitted: found a new group")
    run.add_argument("--store", metavar="HOST:PORT", help="instead of --join: a store that keeps the group's "
                     "addresses (`plait store`); the first process to find no group there founds one, the others "
                     "join it, so every machine runs the same command (sets PLAIT_JOIN_STORE)")
    run.add_argument("--listen", metavar="HOST:PORT", help="where this member listens (default 0.0.0.0:0; give the "
                     "founder a fixed port, e.g. 0.0.0.0:29400)")
    run.add_argument("script", help="the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    wit = sub.add_parser("witness", help="a tie-breaking vote for an elastic group (so that two members survive one loss)",
                         description="Votes in every view change of GROUP as one more acceptor, and holds nothing "
                         "else: a group of two (or any even split) keeps a majority on the side that reaches it. Run it "
                         "where both sides can reach it; give its address to the founder (witness= or PLAIT_WITNESS).")
    wit.add_argument("--listen", default="0.0.0.0:29499", help="where it listens (default 0.0.0.0:29499)")
    wit.add_argument("--group", default="default", help="the group's name (default: default)")
    wit.add_argument("--heartbeat-timeout", type=float, help="as the members' PLAIT_HEARTBEAT_TIMEOUT")
    st = sub.add_parser("store", help="a directory for elastic groups (joiners find the group through it)",
                        description="Serves a torch TCPStore where elastic members keep their group's addresses "
                        "(`plait run --store HOST:PORT`, PLAIT_JOIN_STORE). It is not a master: groups train on "
                        "if it stops; only processes that join through it need it. Needs torch.")
    st.add_argument("--listen", default="0.0.0.0:29400", help="where it listens (default 0.0.0.0:29400)")
    from .trace import add_arguments as trace_arguments

    trace_arguments(sub.add_parser("trace", help="read the traces every rank writes on a timeout or failure"))
    args = parser.parse_args(argv)
    if args.version:
        import plait

        print(f"plait {plait.__version__}")
        return 0
    if args.command == "demo":
        if args.nproc < 2:
            parser.error("--nproc must be at least 2")
        from .demo import run

        return run(nproc=args.nproc, quick=args.quick, json_path=args.json, mesh=not args.no_mesh)
    if args.command == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(args)
    if args.command == "topology":
        from .topology import main as topology_main

        return topology_main(args)
    if args.command == "bench":
        from .bench import check_args, run as bench_run

        check_args(bench, args)
        return bench_run(args)
    if args.command == "schedule":
        from .schedule import main as schedule_main

        return schedule_main(args)
    if args.command == "testbed":
        return _testbed(args, parser)
    if args.command == "witness":
        from ..elastic import witness

        w = witness(args.listen, group=args.group, heartbeat_timeout=args.heartbeat_timeout)
        print(f"plait witness for group {args.group!r} at {w.contact}", flush=True)
        try:
            _serve_until_stopped()
        finally:
            w.close()
        return 0
    if args.command == "store":
        from .._store import tcp_store

        host, _, port = args.listen.rpartition(":")
        if not port.isdigit():
            parser.error(f"--listen must be HOST:PORT, got {args.listen!r}")
        server = tcp_store(host.strip("[]") or "0.0.0.0", int(port), is_master=True, wait_for_workers=False)
        print(f"plait store at {args.listen} (port {server.port})", flush=True)
        _serve_until_stopped()
        return 0
    if args.command == "run":
        import os
        import subprocess

        if args.join and args.store:
            parser.error("give --join or --store, not both")
        env = dict(os.environ)
        if args.store:
            env["PLAIT_JOIN_STORE"] = args.store
            env.pop("PLAIT_JOIN", None)
        if args.join:
            env["PLAIT_JOIN"] = ",".join(args.join)
            env.pop("PLAIT_JOIN_STORE", None)
        if args.listen:
            env["PLAIT_LISTEN"] = args.listen
        return subprocess.call([sys.executable, args.script, *args.args], env=env)
    if args.command == "trace":
        from .trace import main as trace_main

        return trace_main(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
