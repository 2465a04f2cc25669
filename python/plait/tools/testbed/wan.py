"""WAN cables for the testbed: a one-way delay, a rate and optionally a loss rate per direction.

netem is not available on every kernel (this project's machines have only the HTB, TBF, ingress
and FIFO qdiscs), so a WAN cable is a userspace delay line: a TUN device at each end (in node i
`mesh<j>`, in node j `mesh<i>`, same addresses, subnet and names as a veth cable) and one forwarder
process per cable (`_wan_forwarder.py`) that reads each packet from one end, holds it, and writes
it into the other. Each direction is one bottleneck router port followed by a wire:

    serialisation at RATE (FIFO, tail drop past QUEUE bytes) -> DELAY -> the other node

Spec (text): cables separated by commas, semicolons or new lines; `#` starts a comment.

    0-1 40ms 200mbit, 1-2 5ms 1gbit, 0-2 80ms 50mbit
    0-1 20ms/30ms 1gbit/100mbit loss=0.1% queue=2mb

- `I-J` names the cable between nodes I and J (0-based, as in --links).
- a time (`40ms`, `0.5ms`, `150us`, `1s`, or `delay=40ms`) is the one-way delay of each direction,
  so the round trip is twice that; a rate (`200mbit`, `1gbit`, `2.5gbit`, `200 Mbit/s`, or
  `rate=...`; `none` for no limit) is each direction's rate. Without a rate the cable gets the
  testbed's link rate.
- `loss=P` (`0.1%` or `0.001`) drops packets at random in each direction. The ends pass 64 KiB TCP
  segments (TSO), so a packet that carries k MTU-sized segments is dropped with probability
  1 - (1 - P)^k: loss events per segment are P as on a real link, but each one loses the whole
  burst of k segments.
- `queue=Q`: the router buffer of each direction, in bytes (`512kb`, `2mb`, as tc reads them:
  1 kb = 1024 bytes) or in time at the rate (`20ms`). Default: one bandwidth-delay product of the
  cable's round trip (rate x (delay there + delay back)), at least 256 KiB.
- `A/B` gives the two directions different values: A is I->J and B is J->I for the pair as written
  (`1-0 5ms/10ms`: 1->0 5 ms, 0->1 10 ms).

Spec (file): `--wan PATH` (or `@PATH`) reads the same text from a file, or JSON when it starts with
`{` or `[`: `{"0-1": {"delay": "40ms", "rate": "200mbit"}, "1-2": {"delay": ["5ms", "7ms"],
"rate": "1gbit", "loss": "0.1%", "queue": "2mb"}}` (a two-item list is I->J, J->I), or a list of
such objects with a `"link": "0-1"` key. Bare JSON numbers are base units: seconds, bit/s, a
fraction, bytes.
"""

import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

FORWARDER = Path(__file__).with_name("_wan_forwarder.py")
PROBE = Path(__file__).with_name("_wan_probe.py")
MIN_QUEUE = 256 * 1024
MAX_DELAY = 10.0

_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
_SIZE = {"b": 1, "": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
         "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_KEYS = ("delay", "rate", "loss", "queue")


class WanSpecError(ValueError):
    """A WAN spec that cannot be read; the message says what is wrong and how to write it."""


@dataclass(frozen=True)
class Direction:
    """One direction of a WAN cable. delay: one-way seconds. rate: bit/s, None = unlimited (or,
    before `resolve`, the testbed's link rate when `rate_given` is False). loss: a fraction.
    queue: bytes (after `resolve`), or queue_s seconds at the rate."""
    delay: float = 0.0
    rate: Optional[int] = None
    rate_given: bool = False
    loss: float = 0.0
    queue: Optional[int] = None
    queue_s: Optional[float] = None

    def to_json(self):
        return {"delay": self.delay, "rate": self.rate, "loss": self.loss, "queue": self.queue}


def _err(item, msg):
    return WanSpecError(f"WAN cable {item!r}: {msg}. Write cables like \"0-1 40ms 200mbit, 1-2 5ms 1gbit "
                        "loss=0.1%\" (see `plait testbed up --help`)")


def _parse_time(v, item):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        t = float(v)
    else:
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(s|ms|us|µs)", str(v).strip().lower())
        if not m:
            raise _err(item, f"delay {v!r}: use a time such as 40ms, 0.5ms, 150us or 1s")
        t = float(m.group(1)) * _TIME[m.group(2)]
    if not 0 <= t <= MAX_DELAY:
        raise _err(item, f"delay {v!r} is out of range (0 to {MAX_DELAY:g} s)")
    return t


def _parse_rate(v, item):
    from . import TestbedError, parse_rate

    if isinstance(v, str):
        v = _norm_units(v)
    try:
        return parse_rate(v)
    except TestbedError as e:
        raise _err(item, str(e)) from None


def _parse_loss(v, item):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        p = float(v)
    else:
        s = str(v).strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%?)", s)
        if not m:
            raise _err(item, f"loss {v!r}: use a percentage such as 0.1% or a fraction such as 0.001")
        p = float(m.group(1)) / (100.0 if m.group(2) else 1.0)
    if not 0 <= p < 1:
        raise _err(item, f"loss {v!r} is out of range (0 to below 100%)")
    return p


def _parse_queue(v, item):
    """-> (bytes, None) or (None, seconds)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return int(v), None
    s = str(v).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(s|ms|us|µs)", s)
    if m:
        return None, float(m.group(1)) * _TIME[m.group(2)]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]?i?b?)", s)
    if not m or m.group(2) not in _SIZE:
        raise _err(item, f"queue {v!r}: use bytes such as 512kb or 2mb, or a time at the rate such as 20ms")
    n = int(float(m.group(1)) * _SIZE[m.group(2)])
    if n < 1500:
        raise _err(item, f"queue {v!r} is smaller than one packet")
    return n, None


def _norm_units(s):
    s = re.sub(r"(?i)\b([0-9.]+)\s*([kmgt]?)(?:bps|bit/s|b/s)\b", r"\1\2bit", s)
    return re.sub(r"(?i)([0-9.])\s+(s|ms|us|µs|[kmgt]?bit|%)(?=$|[\s/,;])", r"\1\2", s)


def _pair(v):
    """'a/b' or [a, b] -> (a, b); a -> (a, a)."""
    if isinstance(v, (list, tuple)):
        if len(v) != 2:
            raise ValueError(v)
        return v[0], v[1]
    if isinstance(v, str) and "/" in v:
        a, b = v.split("/", 1)
        return a, b
    return v, v


def _link(text, item):
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(text))
    if not m:
        raise _err(item, f"{text!r} is not a cable: name it by its two nodes, such as 0-1")
    i, j = int(m.group(1)), int(m.group(2))
    if i == j:
        raise _err(item, "a cable joins two different nodes")
    return i, j


def _cable(i, j, attrs, item):
    """attrs: {key: value or (a, b)} -> ((lo, hi), (Direction lo->hi, Direction hi->lo))."""
    fwd, back = {}, {}
    for key, v in attrs.items():
        try:
            a, b = _pair(v)
        except ValueError:
            raise _err(item, f"{key} {v!r}: give one value, or two (I->J, J->I)") from None
        for d, x in ((fwd, a), (back, b)):
            if key == "delay":
                d["delay"] = _parse_time(x, item)
            elif key == "rate":
                d["rate"], d["rate_given"] = _parse_rate(x, item), True
            elif key == "loss":
                d["loss"] = _parse_loss(x, item)
            elif key == "queue":
                if x is not None:  # None: the default
                    d["queue"], d["queue_s"] = _parse_queue(x, item)
            else:
                raise _err(item, f"unknown setting {key!r}: use delay, rate, loss or queue")
    ij, ji = Direction(**fwd), Direction(**back)
    return ((i, j), (ij, ji)) if i < j else ((j, i), (ji, ij))


def _parse_item(item):
    s = _norm_units(item.strip())
    toks = s.split()
    i, j = _link(toks[0], item)
    attrs = {}
    k = 1
    while k < len(toks):
        t = toks[k]
        if "=" in t:
            key, v = t.split("=", 1)
            key = key.lower()
        elif t.lower() in _KEYS:
            if k + 1 >= len(toks):
                raise _err(item, f"{t!r} needs a value")
            key, v = t.lower(), toks[k + 1]
            k += 1
        else:
            first = t.split("/", 1)[0].lower()
            if re.fullmatch(r"[0-9]*\.?[0-9]+(s|ms|us|µs)", first):
                key = "delay"
            elif re.fullmatch(r"[0-9]*\.?[0-9]+[kmgt]?bit", first) or first in ("none", "unlimited"):
                key = "rate"
            elif re.fullmatch(r"[0-9]*\.?[0-9]+%", first):
                key = "loss"
            else:
                raise _err(item, f"{t!r} is neither a delay (40ms), a rate (200mbit), a loss (0.1%) nor key=value")
            v = t
        if key in attrs:
            raise _err(item, f"{key} is given twice")
        attrs[key] = v
        k += 1
    return _cable(i, j, attrs, item)


def _from_json(obj):
    cables = []
    if isinstance(obj, dict):
        obj = [dict(v, link=k) if isinstance(v, dict) else v for k, v in obj.items()]
    if not isinstance(obj, list):
        raise WanSpecError("a JSON WAN spec is an object {\"0-1\": {\"delay\": \"40ms\", \"rate\": \"200mbit\"}, ...} "
                           "or a list of such objects with a \"link\" key")
    for c in obj:
        if not isinstance(c, dict) or "link" not in c:
            raise WanSpecError(f"WAN cable {c!r}: an object with a \"link\" (\"0-1\") and delay, rate, loss, queue")
        link = c["link"]
        item = json.dumps(c)
        i, j = _link("-".join(map(str, link)) if isinstance(link, (list, tuple)) else link, item)
        cables.append(_cable(i, j, {k: v for k, v in c.items() if k != "link"}, item))
    return cables


def parse_wan(spec):
    """A WAN spec -> {(i, j): (Direction i->j, Direction j->i)} with i < j (not yet resolved
    against a testbed: see `resolve`). spec: the text form, a path (or "@path") of a text or JSON
    file, a dict such as {"0-1": {"delay": "40ms"}} or {(0, 1): {...}}, or None/"" for none."""
    if spec is None:
        return {}
    if isinstance(spec, dict) and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], Direction)
                                      for v in spec.values()):
        return {tuple(sorted(k)): v if k[0] < k[1] else (v[1], v[0]) for k, v in spec.items()}
    if isinstance(spec, dict):
        cables = _from_json({(f"{k[0]}-{k[1]}" if isinstance(k, tuple) else k): v for k, v in spec.items()})
    elif isinstance(spec, list):
        cables = _from_json(spec)
    else:
        text = str(spec).strip()
        path = Path(text[1:] if text.startswith("@") else text)
        if text.startswith("@") or (text and "\n" not in text and len(text) < 4096 and path.is_file()):
            try:
                text = path.read_text()
            except OSError as e:
                raise WanSpecError(f"WAN spec file {str(path)!r}: {e}") from None
        if text.lstrip().startswith(("{", "[")):
            try:
                cables = _from_json(json.loads(text))
            except ValueError as e:
                raise WanSpecError(f"WAN spec: not valid JSON: {e}") from None
        else:
            lines = [ln.split("#", 1)[0] for ln in text.splitlines()]
            items = [x for ln in lines for x in re.split(r"[,;]", ln) if x.strip()]
            cables = [_parse_item(x) for x in items]
    out = {}
    for key, dirs in cables:
        if key in out:
            raise WanSpecError(f"WAN cable {key[0]}-{key[1]} is given twice")
        out[key] = dirs
    return out


def resolve(cables, link_bps):
    """Fills in the testbed's link rate where a cable gives none, and each direction's queue in
    bytes (default: one bandwidth-delay product of the round trip, at least MIN_QUEUE)."""
    out = {}
    for key, (ij, ji) in cables.items():
        rtt = ij.delay + ji.delay
        dirs = []
        for d in (ij, ji):
            rate = d.rate if d.rate_given else link_bps
            if rate is None:
                queue = None
            elif d.queue is not None:
                queue = d.queue
            elif d.queue_s is not None:
                queue = max(1500, int(rate / 8 * d.queue_s))
            else:
                queue = max(MIN_QUEUE, int(rate / 8 * rtt))
            dirs.append(replace(d, rate=rate, rate_given=True, queue=queue, queue_s=None))
        out[key] = tuple(dirs)
    return out


def to_json(cables):
    """Resolved cables -> JSON (base units), which parse_wan reads back."""
    return {f"{i}-{j}": {k: [a, b] for k, a, b in zip(_KEYS, _vals(ij), _vals(ji))}
            for (i, j), (ij, ji) in sorted(cables.items())}


def _vals(d):
    return d.delay, d.rate, d.loss, d.queue


def describe_direction(d):
    from . import format_rate

    s = f"{d.delay * 1e3:g}ms {format_rate(d.rate)}"
    if d.loss:
        s += f" loss {d.loss * 100:g}%"
    return s


def describe_cable(ij, ji):
    """`20ms 200mbit`, or `20ms 1gbit / 30ms 100mbit` (I->J / J->I) when the directions differ."""
    a, b = describe_direction(ij), describe_direction(ji)
    return a if a == b else f"{a} / {b}"


def bdp_bytes(cables):
    """The largest rate x round trip + queue over the cables (bytes), for sizing TCP buffers."""
    worst = 0
    for ij, ji in cables.values():
        rtt = ij.delay + ji.delay
        for d in (ij, ji):
            if d.rate:
                worst = max(worst, int(d.rate / 8 * rtt) + (d.queue or 0))
    return worst


# A stock Linux kernel's autotuning limits (min, default, max bytes): one TCP stream there keeps at
# most about 4 MiB in flight, a quarter of a 100 ms, 1 Gbit/s cable's bandwidth-delay product.
STOCK_TCP_BUFFERS = {"tcp_rmem": "4096 131072 6291456", "tcp_wmem": "4096 16384 4194304"}


def tcp_buffer_max(cables, current_max):
    """tcp_rmem/tcp_wmem max for the nodes of a testbed with these cables: 4x the largest
    (bandwidth-delay product + queue), at least 16 MiB and the system's, at most 256 MiB."""
    need = min(256 << 20, max(16 << 20, 4 * bdp_bytes(cables)))
    return max(need, current_max or 0)


# -- checking a cable: ping and a TCP stream -------------------------------------------------------
def _probe(tb, node, args, **kw):
    import subprocess

    return tb.popen(node, [sys.executable, str(PROBE)] + [str(a) for a in args], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, **kw)


def _last_json(out):
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"probe printed no result: {out[-500:]!r}")


def ping(tb, i, j, count=10, interval=0.05, wait=2.0):
    """Round trips (ms) of `count` ICMP echoes from node i to node j's address on their cable, one
    at a time, each waiting `wait` seconds at most for its reply: {"rtt_ms": [...], "lost": n}."""
    from . import cable_addr

    p = _probe(tb, i, ["ping", cable_addr(j, i), count, interval, wait])
    out, err = p.communicate(timeout=count * (interval + wait) + 10)
    if p.returncode != 0:
        raise RuntimeError(f"ping from node {i} to {j} failed: {err.strip()[-500:]}")
    return _last_json(out)


def tcp_stream(tb, i, j, seconds=4.0, warmup=1.5, port=5201, congestion=None):
    """A plain TCP stream from node i to node j over their cable for `seconds`; returns the rate
    (bit/s) the receiver saw after `warmup` seconds (slow start left out), and the samples.
    congestion: the sender's congestion control (e.g. "cubic"), default the node's."""
    from . import cable_addr

    sink = _probe(tb, j, ["sink", cable_addr(j, i), port, seconds])
    try:
        line = sink.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"TCP sink on node {j} did not start: {line!r} {sink.stderr.read()[-500:]}")
        src = _probe(tb, i, ["source", cable_addr(j, i), port, seconds] + ([congestion] if congestion else []))
        src_out, src_err = src.communicate(timeout=seconds + 60)
        if src.returncode != 0:
            raise RuntimeError(f"TCP source on node {i} failed: {src_err.strip()[-500:]}")
        out, err = sink.communicate(timeout=30)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    samples = _last_json(out)["samples"]
    base = next((s for s in samples if s[0] >= warmup), None)
    last = samples[-1]
    if base is None or last[0] - base[0] < 0.5:
        raise RuntimeError(f"TCP stream {i}->{j} too short to measure: {samples[-3:]}")
    rate = (last[1] - base[1]) * 8 / (last[0] - base[0])
    return {"bps": rate, "bytes": last[1], "seconds": last[0], "samples": samples}


def goodput(rate_bps, mtu=1500):
    """The TCP payload rate a link of this rate carries at full use (IPv4, TCP timestamps): the
    rate less 52 bytes of headers per MTU-sized packet."""
    return rate_bps * (mtu - 52) / mtu


def check_cable(tb, i, j, *, pings=10, seconds=4.0, warmup=1.5, both=True, congestion=None):
    """Configured vs measured for the cable i-j of a testbed that is up: the median ping round trip
    and a TCP stream each way (one after the other). Returns a dict."""
    cables = tb.wan
    key = (min(i, j), max(i, j))
    if key not in cables:
        raise KeyError(f"{i}-{j} is not a WAN cable of this testbed")
    ij, ji = cables[key] if i < j else cables[key][::-1]
    pr = ping(tb, i, j, count=pings)
    rtts = sorted(pr["rtt_ms"])
    out = {"link": f"{i}-{j}", "rtt_ms_configured": (ij.delay + ji.delay) * 1e3,
           "rtt_ms_median": rtts[len(rtts) // 2] if rtts else None, "rtt_ms_min": rtts[0] if rtts else None,
           "pings_lost": pr["lost"], "directions": []}
    for a, b, d in ((i, j, ij), (j, i, ji)) if both else ((i, j, ij),):
        tr = tcp_stream(tb, a, b, seconds=seconds, warmup=warmup, congestion=congestion)
        out["directions"].append({"from": a, "to": b, "rate_bps": d.rate,
                                  "goodput_bps_expected": goodput(d.rate) if d.rate else None,
                                  "tcp_bps": tr["bps"]})
    return out

