"""`plait trace show DIR`: reads every rank's trace (plait_trace_rank_<R>.json, written by the torch
backend when an operation times out or fails, see plait/torch/trace.py) and says, per group, the
last operation every rank completed, where the ranks diverge, and which rank never arrived."""

import glob
import json
import math
import os
import re
import sys

from ._jsonout import add_json_option


def add_arguments(p):
    sub = p.add_subparsers(dest="trace_command", metavar="action")
    show = sub.add_parser("show", help="per group: where the ranks diverge and which rank never arrived",
                          description="Reads DIR/plait_trace_rank_<R>.json of every rank (written on a timeout or "
                          "failure to PLAIT_TRACE_DIR, default <temp dir>/plait-trace) and prints, per process group, "
                          "the last operation every rank completed, the operation where they diverge, and the "
                          "rank(s) that never arrived there.")
    show.add_argument("dir", nargs="?", help="the trace directory (default: PLAIT_TRACE_DIR or <temp dir>/plait-trace)")
    show.add_argument("--job", help="the job whose traces to read, when DIR holds several (default: the newest)")
    add_json_option(show, help="also write the analysis as JSON to PATH; `--json -` (or --json alone) writes it to "
                    "stdout instead of the text")
    return p


def main(args):
    if getattr(args, "trace_command", None) != "show":
        print("usage: plait trace show [DIR] [--json PATH|-]", file=sys.stderr)
        return 2
    d = args.dir or os.environ.get("PLAIT_TRACE_DIR") or os.path.join(__import__("tempfile").gettempdir(), "plait-trace")
    try:
        report = analyse(load(d, args.job))
    except TraceError as e:
        print(f"plait trace show: {e}", file=sys.stderr)
        return 1
    report["dir"] = d
    if args.json == "-":
        print(json.dumps(report, indent=1))
        return 0
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


class TraceError(Exception):
    pass


def load(d, job=None):
    """{rank: trace document} of one job in directory `d` (the newest, or `job`)."""
    if not os.path.isdir(d):
        raise TraceError(f"{d} is not a directory")
    docs = []
    for path in sorted(glob.glob(os.path.join(d, "plait_trace_rank_*.json"))):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise TraceError(f"{path}: {e}") from None
        if doc.get("plait_trace") != 1:
            continue
        doc["_path"] = path
        docs.append(doc)
    if not docs:
        raise TraceError(f"no plait traces (plait_trace_rank_<R>.json) in {d}")
    jobs = {}
    for doc in docs:
        jobs.setdefault(doc.get("job", ""), []).append(doc)
    if job is None:
        job = max(jobs, key=lambda j: max(doc["time_ns"] for doc in jobs[j]))
    elif job not in jobs:
        raise TraceError(f"no traces of job {job!r} in {d}; jobs there: {', '.join(map(repr, jobs))}")
    return {"job": job, "other_jobs": sorted(j for j in jobs if j != job),
            "ranks": {doc["rank"]: doc for doc in jobs[job]}}


def _elems(sizes):
    return sum(math.prod(s) for s in sizes)


def _op(e):
    """An entry as a short phrase: all_reduce #42 (float32, 1024 elems)."""
    if e is None:
        return "none"
    n = f"#{e['p2p_seq_id']}" if e["is_p2p"] else f"#{e['collective_seq_id']}"
    dts = sorted(set(e["input_dtypes"] or e["output_dtypes"]))
    sizes = e["input_sizes"] or e["output_sizes"]
    bits = []
    if dts:
        bits.append(",".join(dts))
    if sizes:
        bits.append(f"{_elems(sizes)} elems")
    if e.get("root") is not None:
        bits.append(f"root {e['root']}")
    if e["is_p2p"]:
        bits.append(f"peer {e['peer'] if e['peer'] is not None and e['peer'] >= 0 else 'any'}")
    return f"{e['op']} {n}" + (f" ({', '.join(bits)})" if bits else "")


def _detailed(e):
    """An entry with its shapes, dtypes and op, for telling two calls apart."""
    bits = [f"inputs {e['input_sizes']} {e['input_dtypes']}", f"outputs {e['output_sizes']} {e['output_dtypes']}"]
    for k in ("root", "reduce_op"):
        if e.get(k) is not None:
            bits.append(f"{k.replace('_', ' ')} {e[k]}")
    return f"{e['op']} ({'; '.join(bits)})"


def _ranks(rs):
    rs = sorted(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def _same_call(a, b):
    keys = ("op", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes", "root", "reduce_op")
    return all(a.get(k) == b.get(k) for k in keys)


def analyse(loaded):
    """Per group: where its ranks are."""
    by_rank = loaded["ranks"]
    groups = {}  # (name, ranks) -> {global rank: group record}
    for rank, doc in by_rank.items():
        for g in doc["groups"]:
            groups.setdefault((g["name"], tuple(g["ranks"])), {})[rank] = g
    out = []
    for (name, ranks), per in sorted(groups.items(), key=lambda kv: (len(kv[0][1]) != len(by_rank), kv[0][0])):
        out.append(_group(name, list(ranks), per, by_rank))
    return {"job": loaded["job"], "other_jobs": loaded["other_jobs"], "ranks_with_trace": sorted(by_rank),
            "reasons": {str(r): doc.get("reason") for r, doc in sorted(by_rank.items())}, "groups": out}


def _group(name, ranks, per, by_rank):
    any_g = next(iter(per.values()))
    res = {"name": name, "desc": any_g.get("desc"), "ranks": ranks, "no_trace": sorted(r for r in ranks if r not in per)}
    colls = {r: [e for e in g["entries"] if not e["is_p2p"]] for r, g in per.items()}
    by_seq = {r: {e["collective_seq_id"]: e for e in es} for r, es in colls.items()}
    last = {r: (es[-1] if es else None) for r, es in colls.items()}
    done = {r: max((e["collective_seq_id"] for e in es if e["state"] == "completed"), default=0) for r, es in colls.items()}
    res["last_completed"] = {str(r): _brief(by_seq[r].get(done[r])) for r in sorted(per)}
    # The first sequence number where the ranks made different calls (within what every trace still holds).
    lo = max((min(s) for s in by_seq.values() if s), default=1)
    hi = min((max(s) for s in by_seq.values() if s), default=0)
    diverged = None
    for seq in range(lo, hi + 1):
        calls = {r: by_seq[r].get(seq) for r in per}
        if any(c is None for c in calls.values()):
            continue
        first = next(iter(calls.values()))
        if not all(_same_call(first, c) for c in calls.values()):
            kinds = {}
            for r, c in sorted(calls.items()):
                kinds.setdefault(json.dumps(_brief(c), sort_keys=True), (c, []))[1].append(r)
            diverged = {"seq": seq, "calls": [{"ranks": rs, "op": _brief(c), "text": _detailed(c)} for c, rs in kinds.values()]}
            break
    res["diverged"] = diverged
    top = max((e["collective_seq_id"] for e in last.values() if e is not None), default=0)
    res["seq"] = top
    at = {r: by_seq[r].get(top) for r in per}
    arrived = sorted(r for r, e in at.items() if e is not None)
    behind = sorted(r for r in per if at[r] is None)
    res["op"] = _brief(at[arrived[0]]) if arrived else None
    res["waiting"] = sorted(r for r in arrived if at[r]["state"] in ("scheduled", "started"))
    res["failed"] = sorted(r for r in arrived if at[r]["state"] == "failed")
    res["completed"] = sorted(r for r in arrived if at[r]["state"] == "completed")
    res["never_arrived"] = behind
    res["never_arrived_last"] = {str(r): _brief(last[r]) for r in behind}
    res["errors"] = {str(r): at[r]["error"] for r in arrived if at[r].get("error")}
    p2p = {r: [e for e in g["entries"] if e["is_p2p"] and e["state"] in ("scheduled", "started", "failed")]
           for r, g in per.items()}
    res["p2p_pending"] = {str(r): [_brief(e) for e in es] for r, es in p2p.items() if es}
    res["message"] = _message(res, at, last, by_rank)
    return res


def _brief(e):
    if e is None:
        return None
    keep = ("op", "collective_seq_id", "p2p_seq_id", "is_p2p", "peer", "root", "reduce_op", "input_sizes", "input_dtypes",
            "output_sizes", "output_dtypes", "state", "error")
    d = {k: e.get(k) for k in keep}
    d["text"] = _op(e)
    return d


def _message(res, at, last, by_rank):
    head = f"group {res['name']}" + (f" ({res['desc']})" if res.get("desc") not in (None, "undefined") else "")
    lines = []
    if res["diverged"] is not None:
        dv = res["diverged"]
        lines.append(f"{head}: the ranks made different calls at #{dv['seq']}: "
                     + "; ".join(f"{_ranks(c['ranks'])} {c['text']}" for c in dv["calls"]))
    if res["op"] is None:
        lines.append(f"{head}: no collective recorded")
        return "\n".join(lines)
    op = res["op"]["text"]
    parts = []
    if res["waiting"]:
        parts.append(f"{_ranks(res['waiting'])} waiting")
    if res["failed"]:
        parts.append(f"{_ranks(res['failed'])} failed")
    if res["completed"] and (res["waiting"] or res["failed"] or res["never_arrived"]):
        parts.append(f"{_ranks(res['completed'])} completed it")
    for r in res["never_arrived"]:
        e = last[r]
        parts.append(f"rank {r} never arrived (its last op: {_op(e)}, {e['state']})" if e is not None
                     else f"rank {r} never arrived (no call of this group in its trace)")
    for r in res["no_trace"]:
        parts.append(f"rank {r} wrote no trace (was it killed? its own log says)")
    if not (res["waiting"] or res["failed"] or res["never_arrived"] or res["no_trace"]):
        lines.append(f"{head}: every rank completed {op}, its last collective")
    else:
        lines.append(f"{head}: {op}: " + "; ".join(parts))
    errs = {}
    for r, e in sorted(res["errors"].items(), key=lambda kv: int(kv[0])):
        errs.setdefault(re.sub(r" \[process group [^\]]*\]", "", e), []).append(int(r))
    for e, rs in list(errs.items())[:3]:
        e = e if len(e) < 400 else e[:397] + "..."
        lines.append(f"  {_ranks(rs)}: {e}")
    for r, es in sorted(res["p2p_pending"].items()):
        lines.append(f"  rank {r} point-to-point not completed: " + ", ".join(e["text"] + " " + e["state"] for e in es[:4])
                     + (f" and {len(es) - 4} more" if len(es) > 4 else ""))
    return "\n".join(lines)


def render(report):
    lines = [f"traces of {_ranks(report['ranks_with_trace'])} in {report['dir']}"
             + (f" (job {report['job']})" if report["job"] else "")]
    if report["other_jobs"]:
        lines.append(f"  (also traces of other jobs there: {', '.join(report['other_jobs'])}; choose with --job)")
    for g in report["groups"]:
        lines.append(g["message"])
    return "\n".join(lines)


__all__ = ["add_arguments", "main", "load", "analyse", "render"]
