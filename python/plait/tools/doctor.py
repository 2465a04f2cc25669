"""`plait doctor`: what the network between the ranks of a job looks like to plait, and what is wrong
with it.

Run it the way the job runs (torchrun-style environment: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), e.g. `torchrun --nnodes 3 ... -m plait.tools.cli doctor`, `plait testbed run -- plait
doctor`, or `plait doctor --local 3` (3 ranks on this machine). Rank 0 prints:

- every rank's interfaces (as plait sees and publishes them),
- the route plait chose for every pair of ranks, and why,
- a round-trip time matrix (ping-pong of small plait messages over those routes),
- a bandwidth matrix: each pair alone (both directions at once), then every pair at once,
- warnings, each with what to do: a link slower than the rest, an MTU mismatch between the two
  ends of a route, a route that falls back to a shared network while a direct link exists (or
  goes through the OS routing table), a partial mesh, loopback-only addresses in a multi-host
  job, and peers that cannot be reached (exit status 1, naming them).

`--json PATH` writes the same content as JSON to PATH; `--json -` (or `--json` alone) prints it on
stdout instead of the tables. Every wait is bounded (`--timeout`); measurements take a
few seconds in all (`--budget` seconds per bandwidth measurement).
"""

import argparse
import datetime
import ipaddress
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from . import _thunderbolt
from .._store import tcp_store
from ._jsonout import add_json_option, to_stdout, write_json
from ._local import free_port as _free_port, popen_kwargs, stop_all

import numpy as np

PREFIX = "plait-doctor"
RTT_ROUNDS = 20
PROBE_BYTES = 256 * 1024
MAX_BYTES = 64 * 2**20
SLOW_FRACTION = 0.6  # a link below this fraction of the median of the others is "slow"


# -- what each rank publishes ------------------------------------------------------------------------
def _machine_id():
    """The core's host identity (one kernel boot and one network stack = one host), so the doctor
    groups ranks into hosts exactly as the core picks loopback routes; None where the system does
    not say (or an older core). A hostname is no stand-in: two machines can share one, and ranks
    wrongly grouped onto one host would hide the very problems the report looks for."""
    from .. import _core

    return _core.host_identity() if hasattr(_core, "host_identity") else None


def local_interfaces():
    from .. import _core

    if hasattr(_core, "interfaces"):
        return [dict(a) for a in _core.interfaces()]
    return []  # an older core: nothing to show


def _resolve(name):
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)})
    except OSError as e:
        return [f"unresolvable ({e.strerror or e})"]


def rank_info(rank):
    host = socket.gethostname()
    env = {k: os.environ[k] for k in ("PLAIT_IFACE", "PLAIT_ROUTES", "PLAIT_ALGO", "PLAIT_TIMEOUT",
                                        "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR")
           if os.environ.get(k)}
    info = {"rank": rank, "host": host, "host_resolves_to": _resolve(host), "machine": _machine_id(),
            "pid": os.getpid(), "interfaces": local_interfaces(), "env": env}
    # What the fix commands are written for, and (macOS) which devices are Thunderbolt ports and
    # which of them a bridge joins.
    info["platform"] = sys.platform
    info["thunderbolt"] = _thunderbolt.thunderbolt_info()
    return info


# -- measurements (every rank) ------------------------------------------------------------------------
def _pairs(n):
    return [(a, b) for a in range(n) for b in range(a + 1, n)]


def measure_rtt(comm, rank, n, timeout):
    """Median and min round trip (us) of an 8-byte plait message to every peer, per pair in a
    fixed global order (no deadlock: the first unfinished pair always has both ranks ready)."""
    out = {}
    buf = np.zeros(1, np.int64)
    for a, b in _pairs(n):
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        times = []
        for k in range(RTT_ROUNDS + 3):
            if rank == a:
                t0 = time.perf_counter()
                comm.send(buf, peer, tag=11, timeout=timeout)
                comm.recv(buf, peer, tag=12, timeout=timeout)
                if k >= 3:
                    times.append((time.perf_counter() - t0) * 1e6)
            else:
                comm.recv(buf, peer, tag=11, timeout=timeout)
                comm.send(buf, peer, tag=12, timeout=timeout)
        if times:
            out[peer] = {"median_us": statistics.median(times), "min_us": min(times)}
    return out


def _exchange(comm, peer, send, recv, tag, timeout):
    """Sends `send` to peer while receiving `recv` from it; returns the receive time in seconds."""
    t0 = time.perf_counter()
    r = comm.recv(recv, peer, tag=tag, timeout=timeout, async_op=True)
    s = comm.send(send, peer, tag=tag, timeout=timeout, async_op=True)
    r.wait(timeout)
    t = time.perf_counter() - t0
    s.wait(timeout)
    return t


def measure_bandwidth(comm, rank, n, timeout, budget):
    """Per peer: bytes used, receive bandwidth (bit/s) from that peer with the pair alone (both
    directions at once), then with every pair at once."""
    big = np.zeros(MAX_BYTES, np.uint8)
    inbox = np.zeros(MAX_BYTES, np.uint8)
    size = np.zeros(1, np.int64)
    alone, sizes = {}, {}
    for a, b in _pairs(n):
        comm.barrier(timeout=timeout)  # pairs one at a time: nothing else on the wire
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        t = _exchange(comm, peer, big[:PROBE_BYTES], inbox[:PROBE_BYTES], 21, timeout)
        if rank == a:  # the lower rank sizes the measurement to take about `budget` seconds
            est = PROBE_BYTES / max(t, 1e-6)
            size[0] = int(min(MAX_BYTES, max(PROBE_BYTES, est * budget)))
            comm.send(size, peer, tag=22, timeout=timeout)
        else:
            comm.recv(size, peer, tag=22, timeout=timeout)
        nbytes = int(size[0])
        t = _exchange(comm, peer, big[:nbytes], inbox[:nbytes], 23, timeout)
        sizes[peer] = nbytes
        alone[peer] = nbytes * 8 / t
    # Every pair at once, same sizes: how much the links slow each other down.
    comm.barrier(timeout=timeout)
    bufs = {p: np.zeros(sizes[p], np.uint8) for p in sizes}
    # One thread per transfer, each a blocking call: async ops share a small worker pool in the
    # core, where receives posted first could hold every worker while the sends wait behind them.
    done, errors = {}, []
    t0 = time.perf_counter()

    def recv(p):
        try:
            comm.recv(bufs[p], p, tag=24, timeout=timeout)
            done[p] = time.perf_counter() - t0
        except Exception as e:
            errors.append(e)

    def send(p):
        try:
            comm.send(big[:sizes[p]], p, tag=24, timeout=timeout)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=f, args=(p,), daemon=True) for p in sizes for f in (recv, send)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if errors:
        raise errors[0]
    if len(done) < len(sizes):
        raise TimeoutError(f"bandwidth (all pairs at once): nothing from ranks {sorted(set(sizes) - set(done))} "
                           f"after {timeout:g} s")
    together = {p: sizes[p] * 8 / done[p] for p in done}
    return {str(p): {"bytes": sizes[p], "alone_bps": alone[p], "together_bps": together.get(p)} for p in sizes}


# -- a small store (so the doctor starts in a fraction of a second; torch's import takes seconds) ----
class _Server:
    """Rank 0 serves a dict on MASTER_PORT (all addresses, like TCPStore); one thread per client."""

    def __init__(self, port):
        import threading as _t

        self.data, self.cond = {}, _t.Condition()
        self.sock = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", port))
        _t.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        with c:
            while True:
                try:
                    req = _recv_msg(c)
                except (OSError, ConnectionError, ValueError):
                    return
                op, keys = req["op"], req["keys"]
                with self.cond:
                    if op == "set":
                        self.data[keys[0]] = req["value"]
                        self.cond.notify_all()
                        reply = {"ok": True}
                    elif op == "wait":
                        end = time.monotonic() + req["timeout"]
                        while not all(k in self.data for k in keys) and time.monotonic() < end:
                            self.cond.wait(max(0.0, end - time.monotonic()))
                        reply = {"ok": all(k in self.data for k in keys)}
                    elif op == "get":
                        reply = {"ok": keys[0] in self.data, "value": self.data.get(keys[0])}
                    else:
                        reply = {"ok": all(k in self.data for k in keys)}
                try:
                    _send_msg(c, reply)
                except OSError:
                    return

    def close(self):
        self.sock.close()


def _send_msg(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data)


def recv_into(sock, buf, what):
    """Fills the writable buffer `buf` from `sock`; a ConnectionError saying "`what` closed" if
    the peer closes first."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"{what} closed")
        got += k


def _recv_exact(sock, n):
    buf = bytearray(n)
    recv_into(sock, buf, "store connection")
    return bytes(buf)


def _recv_msg(sock):
    n = int.from_bytes(_recv_exact(sock, 4), "big")
    if n > 64 * 2**20:
        raise ValueError("message too large")
    return json.loads(_recv_exact(sock, n))


class DoctorStore:
    """set / get / wait / check, the interface plait's Communicator needs. Values travel as latin-1
    text inside JSON. Rank 0 also serves it."""

    def __init__(self, host, port, is_server, timeout):
        self.server = _Server(port) if is_server else None
        self.timeout = timeout
        self.addr = (host, port)
        self.local = threading.local()
        deadline = time.monotonic() + timeout
        while True:  # the server may not be up yet: retry until the deadline, like TCPStore
            try:
                self._conn()
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no store at {host}:{port} after {timeout:g} s ({e})") from None
                time.sleep(0.1)

    def _conn(self):
        s = getattr(self.local, "sock", None)
        if s is None:
            s = socket.create_connection(self.addr, timeout=5)
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.local.sock = s
        return s

    def _call(self, **req):
        s = self._conn()
        _send_msg(s, req)
        return _recv_msg(s)

    def set(self, key, value):
        if isinstance(value, str):
            value = value.encode()
        self._call(op="set", keys=[key], value=bytes(value).decode("latin-1"))

    def get(self, key):
        self.wait([key])
        return self._call(op="get", keys=[key])["value"].encode("latin-1")

    def wait(self, keys, timeout=None):
        t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else (timeout or self.timeout)
        if not self._call(op="wait", keys=list(keys), timeout=t)["ok"]:
            raise TimeoutError(f"store keys {list(keys)} not set after {t:g} s")

    def check(self, keys):
        return self._call(op="check", keys=list(keys))["ok"]


# -- one rank -----------------------------------------------------------------------------------------
class _Store:
    def __init__(self, store, timeout):
        self.s, self.timeout = store, timeout

    def put(self, key, obj):
        self.s.set(f"{PREFIX}/{key}", json.dumps(obj))

    def get(self, key, timeout=None):
        t = self.timeout if timeout is None else timeout
        self.s.wait([f"{PREFIX}/{key}"], datetime.timedelta(seconds=max(0.1, t)))
        return json.loads(self.s.get(f"{PREFIX}/{key}"))

    def has(self, key):
        return self.s.check([f"{PREFIX}/{key}"])


def _status(rank, msg, quiet):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def open_rank_store(rank, n, master_addr, master_port, timeout):
    """torch's TCPStore wherever torch is installed (under torchrun: the agent's own store on
    MASTER_PORT); the built-in one only for `--local` runs, which pick their own port, and where
    torch is absent."""
    if os.environ.get("PLAIT_DOCTOR_STORE") != "builtin" and importlib.util.find_spec("torch") is not None:
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return tcp_store(master_addr, master_port, n, is_master=(rank == 0 and not agent_store),
                         timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    return DoctorStore(master_addr, master_port, rank == 0, timeout)


def run_rank(rank, n, master_addr, master_port, *, timeout=30.0, budget=0.25, bandwidth=True, json_path=None,
             console=None, measure=False):
    """One rank of the doctor. Rank 0 prints the report (and writes it to `json_path`: "-" is
    stdout, instead of the tables). `measure`: the core measures every link at start-up
    (PLAIT_MEASURE=1) even where it would not on its own. Returns the exit status."""
    t_start = time.monotonic()
    if measure:
        os.environ["PLAIT_MEASURE"] = "1"  # read when the communicator starts, below
    try:
        raw = open_rank_store(rank, n, master_addr, master_port, timeout)
    except Exception as e:
        what = "serve" if rank == 0 else "reach"
        print(f"plait doctor: rank {rank} cannot {what} the store at {master_addr}:{master_port}: {e}\n"
              f"  MASTER_ADDR must be an address of rank 0's machine that every rank can reach "
              f"(it resolves to {', '.join(_resolve(master_addr))} here), and MASTER_PORT a free port there.",
              file=sys.stderr)
        return 2
    store = _Store(raw, timeout)
    stages = {"store": time.monotonic() - t_start}
    store.put(f"info/{rank}", rank_info(rank))
    import plait

    comm, err = None, None
    try:
        comm = plait.Communicator(raw, rank, n, timeout=timeout, group="doctor")
    except Exception as e:
        err = {"stage": "connect", "type": type(e).__name__, "message": str(e)}
    stages["connect"] = time.monotonic() - t_start
    store.put(f"connect/{rank}", err or "ok")
    meas = {"routes": [], "topology": None, "rtt": {}, "bandwidth": {}, "error": err}
    try:
        if comm is not None:
            meas["routes"] = [dict(r) for r in comm.routes()]
            top = getattr(comm, "topology", None) or getattr(comm._comm, "topology", None)
            meas["topology"] = top() if callable(top) else None
            meas["ring_order"] = comm.ring_order()  # from the links the core measured (PLAIT_MEASURE)
            meas["links"] = comm.link_matrix()
            # Measure only if every rank connected; otherwise the peers would wait for nothing.
            everyone = True
            for r in range(n):
                try:
                    if store.get(f"connect/{r}", timeout) != "ok":
                        everyone = False
                except Exception:
                    everyone = False
            if everyone:
                try:
                    stages["everyone_connected"] = time.monotonic() - t_start
                    meas["rtt"] = {str(k): v for k, v in measure_rtt(comm, rank, n, timeout).items()}
                    stages["rtt"] = time.monotonic() - t_start
                    if bandwidth:
                        meas["bandwidth"] = measure_bandwidth(comm, rank, n, timeout, budget)
                        stages["bandwidth"] = time.monotonic() - t_start
                except Exception as e:
                    meas["error"] = {"stage": "measure", "type": type(e).__name__, "message": str(e)}
    finally:
        meas["stages_s"] = stages
        store.put(f"meas/{rank}", meas)
        if comm is not None:
            comm.close()
    if rank != 0:
        store.put(f"done/{rank}", 1)
        return 1 if meas["error"] else 0
    # Rank 0: gather, analyse, print; keep the store up until everyone has read what it needs.
    infos, measures, missing = [], [], []
    for r in range(n):
        try:
            infos.append(store.get(f"info/{r}", 5.0 if r else 0.1))
        except Exception:
            infos.append(None)
            missing.append(r)
    for r in range(n):
        left = max(1.0, timeout + 10 - (time.monotonic() - t_start)) if r not in missing else 0.1
        try:
            measures.append(store.get(f"meas/{r}", left))
        except Exception:
            measures.append(None)
            if r not in missing:
                missing.append(r)
    report = build_report(n, infos, measures, sorted(missing), master_addr=master_addr, master_port=master_port,
                          elapsed=time.monotonic() - t_start, budget=budget)
    if json_path:
        write_json(json_path, report)
    if not to_stdout(json_path):
        print_report(report, console)
    for r in range(1, n):
        if r not in missing:
            try:
                store.get(f"done/{r}", 5.0)
            except Exception:
                pass
    return 0 if report["ok"] else 1


# -- analysis (pure: rank 0's data in, report out) ----------------------------------------------------
def _iface_of(info, ip):
    for a in (info or {}).get("interfaces", []):
        if a["ip"] == ip:
            return a
    return None


def _net(a):
    try:
        return ipaddress.ip_interface(f"{a['ip']}/{a['prefix']}").network
    except ValueError:
        return None


def _at(infos, r):
    return infos[r] if 0 <= r < len(infos) else None


def _is_loopback(ip):
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def _gbps(bps):
    return None if bps is None else bps / 1e9


# The commands a fix names, in the language of the rank's system (its published sys.platform).
_COMMANDS = {
    "route": {"linux": "ip route get {addr}", "darwin": "route -n get {addr}",
              "win32": "Find-NetRoute -RemoteIPAddress {addr}"},
    "links": {"linux": "ip link", "darwin": "ifconfig", "win32": "Get-NetAdapter"},
    "link": {"linux": "ip link show {iface}", "darwin": "ifconfig {iface}", "win32": "Get-NetAdapter -Name '{iface}'"},
    "addrs": {"linux": "ip addr", "darwin": "ifconfig", "win32": "ipconfig"},
    "mtu": {"linux": "ip link set dev {iface} mtu {mtu}", "darwin": "sudo networksetup -setMTU {iface} {mtu}",
            "win32": 'netsh interface ipv4 set subinterface "{iface}" mtu={mtu} store=persistent'},
    "speed": {"linux": "ethtool {iface}", "darwin": "ifconfig {iface}` (its media line) or `networksetup -getMedia "
              "{iface}", "win32": "Get-NetAdapter -Name '{iface}' | Format-List LinkSpeed,FullDuplex"},
    "hosts": {"linux": "/etc/hosts", "darwin": "/etc/hosts", "win32": "C:\\Windows\\System32\\drivers\\etc\\hosts"},
}


def _cmd(info, what, **kw):
    """The command for `what` on the system of the rank whose info this is (Linux when unknown)."""
    plat = (info or {}).get("platform") or "linux"
    table = _COMMANDS[what]
    return table.get("linux" if plat.startswith("linux") else plat, table["linux"]).format(**kw)


def build_report(n, infos, measures, missing, *, master_addr=None, master_port=None, elapsed=None, budget=None):
    warnings = []

    def warn(level, code, message, fix, ranks=()):
        warnings.append({"level": level, "code": code, "message": message, "fix": fix, "ranks": sorted(set(ranks))})

    # A rank of unknown identity is a host of its own, as in the core: two unknowns are not one host.
    machines = {i["machine"] if i.get("machine") is not None else ("unknown", r) for r, i in enumerate(infos) if i}
    multi_host = len(machines) > 1
    for r in missing:
        warn("error", "no_report", f"rank {r} did not report within the timeout (crashed, hung, or cannot reach "
             f"the store at {master_addr}:{master_port})", "run `plait doctor` on that machine alone to see its error; "
             "check that MASTER_ADDR/MASTER_PORT are the same on every rank", [r])
    # Errors while connecting or measuring, naming the peers the core named. A rank that could not
    # connect to a peer is the culprit; the others' errors (timeouts waiting) usually follow from it.
    import re

    # A rank's error may quote another's ("peer rank 2 (...) failed: could not connect to rank
    # 1"): the pair is the quoted one, whichever rank's error says it first.
    culprits = []
    for r, m in enumerate(measures):
        msg = ((m or {}).get("error") or {}).get("message", "")
        relayed = re.search(r"rank (\d+)(?: \([^)]*\))? failed: (?:rendezvous: )?could not connect to rank (\d+)", msg)
        hit = re.search(r"could not connect to rank (\d+)", msg)
        pair = (int(relayed.group(1)), int(relayed.group(2))) if relayed else (r, int(hit.group(1))) if hit else None
        if pair and pair not in culprits:
            culprits.append(pair)
    for r, p in culprits:
        warn("error", "unreachable_peer", f"rank {r} cannot reach rank {p} on any of its addresses "
             f"({infos[p]['host'] if p < len(infos) and infos[p] else 'host unknown'})",
             f"on rank {r}'s machine: `{_cmd(infos[r], 'route', addr=f'<rank {p} address>')}` for each address in the "
             f"interface table; a cable down or unplugged (`{_cmd(infos[r], 'links')}`), a firewall, or a "
             "PLAIT_IFACE/PLAIT_ROUTES setting that leaves only a broken link", [r, p])
    for r, m in enumerate(measures):
        if culprits and m and m.get("error") and all(r != c for c, _ in culprits) and m["error"]["stage"] == "connect":
            warn("note", "connect_consequence", f"rank {r} also failed to connect (most likely because of the "
                 f"above): {m['error']['type']}: {m['error']['message']}", "fix the unreachable pair first", [r])
            continue
        if m and m.get("error"):
            e = m["error"]
            stage = "connecting to its peers" if e["stage"] == "connect" else "measuring"
            warn("error", "unreachable" if e["stage"] == "connect" else "measure_failed",
                 f"rank {r} failed while {stage}: {e['type']}: {e['message']}",
                 "check that the peer named is running and that an interface of this rank shares a subnet with one "
                 f"of the peer's addresses (or that the OS route to it works); `{_cmd(_at(infos, r), 'addrs')}` and "
                 f"`{_cmd(_at(infos, r), 'route', addr='<peer address>')}` on this rank's machine, the same on the "
                 "peer's; PLAIT_IFACE / PLAIT_ROUTES may exclude the only working link", [r])

    # Route matrix from both ends' records.
    routes = [[None] * n for _ in range(n)]
    for r, m in enumerate(measures):
        for rt in (m or {}).get("routes", []):
            routes[r][rt["peer"]] = rt
    tops = {m.get("topology") for m in measures if m and m.get("topology")}
    topology = tops.pop() if len(tops) == 1 else (None if not tops else "disagree: " + ", ".join(sorted(tops)))
    ring_order = next((m["ring_order"] for m in measures if m and m.get("ring_order")), None)
    # Every rank holds the same matrix (each publishes what it measured): any rank's will do.
    start_up_links = next((m["links"] for m in measures if m and m.get("links")), None)

    # Subnets each rank has, to find direct links ("dedicated": only two ranks on that subnet).
    nets = [{} for _ in range(n)]
    for r, info in enumerate(infos):
        for a in (info or {}).get("interfaces", []):
            net = _net(a)
            if net is None or _is_loopback(a["ip"]) or net.prefixlen == net.max_prefixlen:
                continue
            nets[r].setdefault(net, a)
    members = {}
    for r in range(n):
        for net in nets[r]:
            members.setdefault(net, set()).add(r)

    rows = []
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            rt = routes[i][j]
            if rt is None:
                continue
            li, lj = infos[i], infos[j]
            la, ra = _iface_of(li, rt.get("local")), _iface_of(lj, rt.get("remote"))
            chosen_by = rt["reason"]
            if j < i or routes[j][i] is None:
                why = chosen_by
            else:  # i accepted; the choice was made by j, which connected
                why = f"{routes[j][i]['reason']} (chosen by rank {j})"
            net = _net(la) if la else None
            shared_by = len(members.get(net, ())) if net else None
            rows.append({"from": i, "to": j, "local_iface": rt.get("local_iface") or (la or {}).get("name"),
                         "local": rt.get("local"), "remote": rt.get("remote"),
                         "remote_iface": (ra or {}).get("name"), "reason": why,
                         "subnet": str(net) if net else None, "ranks_on_subnet": shared_by,
                         "local_mtu": (la or {}).get("mtu"), "remote_mtu": (ra or {}).get("mtu"),
                         "startup_rtt_us": rt.get("rtt_us"), "via": rt.get("via"),
                         "shared_memory": bool(rt.get("shm_lanes"))})
    # Warnings about routes, once per pair.
    for row in rows:
        i, j = row["from"], row["to"]
        if row["via"] is not None:
            if i < j:
                warn("warning", "relayed_pair",
                     f"ranks {i} and {j} cannot connect to each other, so their frames go through rank {row['via']}, "
                     f"which reaches both: every byte between them crosses two links and passes through rank "
                     f"{row['via']}'s memory ({row['reason']})",
                     f"give the two a route of their own (a cable with its own subnet, or a firewall or NAT that lets "
                     f"rank {j} connect to rank {i}'s port: `{_cmd(infos[j], 'route', addr=f'<rank {i} address>')}` "
                     f"on rank {j}'s machine); until then plait relays (PLAIT_RELAY=0 makes start-up fail instead)",
                     [i, j, row["via"]])
            continue
        if row["local_mtu"] and row["remote_mtu"] and row["local_mtu"] != row["remote_mtu"] and i < j:
            lo = min(row["local_mtu"], row["remote_mtu"])
            warn("warning", "mtu_mismatch",
                 f"MTU mismatch on the route between rank {i} ({row['local_iface']} {row['local']}, MTU "
                 f"{row['local_mtu']}) and rank {j} ({row['remote_iface']} {row['remote']}, MTU {row['remote_mtu']}): "
                 f"frames above {lo} bytes are dropped or fragmented, which can stall or slow TCP",
                 f"set the same MTU on both ends, e.g. `{_cmd(infos[i], 'mtu', iface=row['local_iface'], mtu=lo)}` "
                 f"on rank {i} or "
                 f"raise rank {j}'s {row['remote_iface']} to {max(row['local_mtu'], row['remote_mtu'])}", [i, j])
        if i > j:
            continue
        # Two ranks on one host share every subnet, and loopback beats any cable between them.
        mi, mj = (infos[i] or {}).get("machine"), (infos[j] or {}).get("machine")
        one_host = mi is not None and mi == mj
        direct = [] if one_host else [net for net in nets[i] if members.get(net) == {i, j}]
        uses_direct = row["subnet"] is not None and members.get(ipaddress.ip_network(row["subnet"])) == {i, j}
        if direct and not uses_direct:
            d = direct[0]
            warn("warning", "lan_fallback",
                 f"ranks {i} and {j} talk over {row['local_iface']} ({row['subnet'] or 'OS route'}"
                 + (f", shared by {row['ranks_on_subnet']} ranks" if row["ranks_on_subnet"] else "")
                 + f") although they have a direct link: rank {i} {nets[i][d]['name']} and rank {j} "
                 f"{nets[j][d]['name']} on {d}",
                 f"check that the direct link is up on both ends (`{_cmd(infos[i], 'link', iface=nets[i][d]['name'])}` "
                 f"on rank {i}, `{_cmd(infos[j], 'link', iface=nets[j][d]['name'])}` on rank {j}) and that "
                 "PLAIT_IFACE / PLAIT_ROUTES do not exclude it; the route reason was: "
                 f"{row['reason']}", [i, j])
        elif row["reason"].startswith("no subnet match") or "OS route" in row["reason"]:
            warn("warning", "os_route",
                 f"ranks {i} and {j} share no subnet: plait reaches rank {j} at {row['remote']} through the OS routing "
                 f"table (from {row['local'] or 'any address'}), possibly via a router or a slow network",
                 "give the two machines addresses on a common network (a cable with its own subnet, or the LAN), or "
                 "say which address to use with PLAIT_ROUTES", [i, j])
    # macOS: Thunderbolt ports joined by the Thunderbolt Bridge instead of one subnet per cable.
    _thunderbolt.check(n, infos, rows, warn)
    lacking = [(i, j) for i, j in _pairs(n) if not any(members.get(net) == {i, j} for net in nets[i])]
    if lacking and (len(lacking) < len(_pairs(n)) or topology == "partial_mesh"):
        if True:
            warn("warning", "partial_mesh",
                 "the ranks form a partial mesh: pairs without a direct link: "
                 + ", ".join(f"{i}-{j}" for i, j in lacking)
                 + "; their traffic shares an interface with other pairs, so plait cannot use the full-mesh "
                 "algorithms", "cable the missing pairs (each cable its own subnet) or expect ring-like speed",
                 [x for p in lacking for x in p])

    # Loopback-only ranks in a multi-host job; hostnames that resolve to loopback (gloo's trap).
    for r, info in enumerate(infos):
        if not info:
            continue
        real = [a for a in info["interfaces"] if not _is_loopback(a["ip"])]
        if multi_host and not real:
            warn("error", "loopback_only",
                 f"rank {r} ({info['host']}) has only loopback addresses but the job spans {len(machines)} machines: "
                 "peers cannot reach it", "bring up a network interface with an address on the peers' network "
                 f"(`{_cmd(info, 'addrs')}`), or run all ranks on one machine", [r])
        if multi_host and info["host_resolves_to"] and all(_is_loopback(x) for x in info["host_resolves_to"]
                                                            if not x.startswith("unresolvable")):
            warn("note", "hostname_loopback",
                 f"rank {r}'s hostname {info['host']!r} resolves to {', '.join(info['host_resolves_to'])}: plait does "
                 "not depend on it, but gloo and NCCL's defaults would bind there and fail or hang",
                 f"for gloo set GLOO_SOCKET_IFNAME, or fix {_cmd(info, 'hosts')}", [r])

    # RTT and bandwidth matrices (from the receiving side for bandwidth).
    rtt = [[None] * n for _ in range(n)]
    bw_alone = [[None] * n for _ in range(n)]
    bw_all = [[None] * n for _ in range(n)]
    for r, m in enumerate(measures):
        for p, v in (m or {}).get("rtt", {}).items():
            rtt[r][int(p)] = rtt[int(p)][r] = v["median_us"]
        for p, v in (m or {}).get("bandwidth", {}).items():
            bw_alone[int(p)][r] = v["alone_bps"]  # measured at r, sent by p: the direction p -> r
            bw_all[int(p)][r] = v["together_bps"]
    dirs = [(i, j, bw_alone[i][j]) for i in range(n) for j in range(n) if bw_alone[i][j]]
    if len(dirs) >= 3:
        for i, j, v in dirs:
            others = [w for a, b, w in dirs if (a, b) != (i, j)]
            med = statistics.median(others)
            if v < SLOW_FRACTION * med:
                row = next((x for x in rows if x["from"] == i and x["to"] == j), {})
                warn("warning", "slow_link",
                     f"rank {i} -> rank {j} ({row.get('local_iface')} {row.get('local')} -> {row.get('remote')}) "
                     f"measures {v / 1e9:.3g} Gbit/s, the median of the other directions is {med / 1e9:.3g} Gbit/s",
                     "check the link's negotiated speed and duplex "
                     f"(`{_cmd(_at(infos, i), 'speed', iface=row.get('local_iface'))}`), the cable, "
                     "and whether this route goes over a slower or busier network than the others; the whole "
                     "collective runs at the pace of its slowest link", [i, j])
    if topology == "full_mesh":
        slow = [(i, j) for i in range(n) for j in range(n)
                if bw_alone[i][j] and bw_all[i][j] and bw_all[i][j] < 0.6 * bw_alone[i][j]]
        if len(slow) > n:
            warn("note", "links_contend",
                 f"with every pair sending at once, {len(slow)} of {n * (n - 1)} directions drop below 60% of their "
                 "speed alone: the links share a bottleneck (CPU, a PCIe/USB controller or a common network)",
                 "check CPU load during training (`top`), and that the cables are really separate links", [])

    errors = [w for w in warnings if w["level"] == "error"]
    return {
        "world_size": n, "master": f"{master_addr}:{master_port}", "topology": topology, "multi_host": multi_host,
        "ring_order": ring_order, "start_up_links": start_up_links,
        "hosts": [(i or {}).get("host") for i in infos], "ranks": infos, "routes": rows,
        "rtt_us": rtt, "bandwidth_alone_gbps": [[_gbps(v) for v in row] for row in bw_alone],
        "bandwidth_all_at_once_gbps": [[_gbps(v) for v in row] for row in bw_all],
        "warnings": warnings, "ok": not errors, "elapsed_s": elapsed, "budget_s": budget,
        "stages_s": [(m or {}).get("stages_s") for m in measures],
    }


# -- printing ------------------------------------------------------------------------------------------
def _fmt_rate(g):
    if g is None:
        return "-"
    return f"{g:.2f}" if g >= 0.1 else f"{g * 1e3:.1f} M"


def print_report(rep, console=None):
    from ._ui import Console, Table

    console = console or Console(width=max(120, Console().width))
    n = rep["world_size"]
    order = rep.get("ring_order")
    console.print(f"[bold]plait doctor[/]: {n} ranks on {len(set(h for h in rep['hosts'] if h))} host(s), store at "
                  f"{rep['master']}, topology [bold]{rep['topology'] or 'unknown'}[/]"
                  + (f", ring order {' > '.join(map(str, order))} (`plait topology` shows why)" if order else ""),
                  highlight=False)
    t = Table(title="Interfaces (as each rank publishes them)", title_justify="left")
    for c in ("rank", "host", "interface", "address", "MTU", "speed"):
        t.add_column(c)
    for r, info in enumerate(rep["ranks"]):
        if not info:
            t.add_row(str(r), "[red]no report", "", "", "", "")
            continue
        for k, a in enumerate(info["interfaces"]):
            t.add_row(str(r) if k == 0 else "", info["host"] if k == 0 else "", a["name"], f"{a['ip']}/{a['prefix']}",
                      str(a.get("mtu") or "?"), f"{a['speed_mbps']} Mbit/s" if a.get("speed_mbps") else "?")
        t.add_section()
    console.print(t)
    if rep["routes"]:
        t = Table(title="Routes (from -> to: local interface and address -> peer address, and why)",
                  title_justify="left")
        for c in ("from", "to", "via", "local -> remote", "subnet", "MTU", "why"):
            t.add_column(c, overflow="fold")
        for row in rep["routes"]:
            mtu = f"{row['local_mtu'] or '?'}/{row['remote_mtu'] or '?'}" \
                if row["local_mtu"] or row["remote_mtu"] else "?"
            if row["local_mtu"] and row["remote_mtu"] and row["local_mtu"] != row["remote_mtu"]:
                mtu = f"[yellow]{mtu}"
            sub = row["subnet"] or "-"
            if row["ranks_on_subnet"] and row["ranks_on_subnet"] > 2:
                sub += f" [dim](shared by {row['ranks_on_subnet']})"
            ends = f"{row['local']} -> {row['remote']}" if row["via"] is None else f"through rank {row['via']}"
            if row.get("shared_memory"):
                ends += ", payloads over 64 KiB in shared memory"
            t.add_row(str(row["from"]), str(row["to"]), row["local_iface"] or "?", ends, sub, mtu, row["reason"])
        console.print(t)

    if rep.get("start_up_links"):
        from .topology import links_table

        console.print(links_table(rep["start_up_links"], "Links as start-up measured them (what the cost model and "
                                  "the ring order use): Mbit/s (one-way latency ms), from row to column"))

    def matrix(title, m, fmt):
        if not any(v is not None for row in m for v in row):
            return
        t = Table(title=title, title_justify="left")
        t.add_column("from \\ to", justify="right")
        for j in range(n):
            t.add_column(str(j), justify="right")
        for i in range(n):
            t.add_row(str(i), *("" if i == j else fmt(m[i][j]) for j in range(n)))
        console.print(t)

    matrix("Round trip, median of 20 ping-pongs of 8 bytes (us)", rep["rtt_us"],
           lambda v: "-" if v is None else f"{v:.0f}")
    matrix("Bandwidth, each pair alone, both directions at once (Gbit/s)", rep["bandwidth_alone_gbps"], _fmt_rate)
    matrix("Bandwidth, every pair at once (Gbit/s)", rep["bandwidth_all_at_once_gbps"], _fmt_rate)
    style = {"error": "bold red", "warning": "yellow", "note": "cyan"}
    for w in rep["warnings"]:
        console.print(f"[{style[w['level']]}]{w['level']}[/] ({w['code']}): {w['message']}", highlight=False)
        console.print(f"    [dim]what to do:[/] {w['fix']}", highlight=False)
    errs = sum(w["level"] == "error" for w in rep["warnings"])
    warns = sum(w["level"] == "warning" for w in rep["warnings"])
    took = f" in {rep['elapsed_s']:.1f} s" if rep.get("elapsed_s") else ""
    if errs:
        console.print(f"[bold red]{errs} error(s), {warns} warning(s){took}")
    elif warns:
        console.print(f"[bold yellow]{warns} warning(s){took}")
    else:
        console.print(f"[bold green]no problems found{took}")


# -- entry points ----------------------------------------------------------------------------------------
def run_local(n, args_list, timeout):
    """`--local n`: n ranks on this machine over loopback; rank 0's output is ours."""
    return run_local_command("doctor", n, args_list, timeout)


def run_local_command(command, n, args_list, timeout):
    """`plait COMMAND ARGS` as n ranks on this machine over loopback (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT set); rank 0's output is ours, the others' errors are shown if they
    fail. Returns rank 0's exit status."""
    port = _free_port()
    procs = []
    logs = []
    import tempfile

    try:
        for r in range(n):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PLAIT_DOCTOR_STORE="builtin")
            log = tempfile.TemporaryFile()
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "plait.tools.cli", command] + args_list, env=env,
                                          stdout=None if r == 0 else subprocess.DEVNULL,
                                          stderr=None if r == 0 else log, **popen_kwargs()))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"plait {command}: ranks still running after {timeout:g} s; killing them", file=sys.stderr)
                break
    finally:
        stop_all(procs)
    for r, (p, log) in enumerate(zip(procs, logs)):
        if r and p.returncode not in (0, 1):
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-10:]
            print(f"plait {command}: rank {r} exited with status {p.returncode}", file=sys.stderr)
            for line in tail:
                print(f"  {line}", file=sys.stderr)
    return procs[0].returncode if procs[0].returncode is not None else 1


def run_as_job_rank(command, run):
    """`run(rank, world size, MASTER_ADDR, MASTER_PORT)` for the rank the launcher's environment
    names (exit 2 when it names none); its exit status, 130 on Ctrl-C, 1 after printing an
    unexpected error with the rank."""
    job = job_env(command)
    if job is None:
        return 2
    try:
        return run(*job)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        print(f"plait {command}: rank {job[0]}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}",
              file=sys.stderr)
        return 1


def job_env(command):
    """(rank, world size, MASTER_ADDR, MASTER_PORT) from the environment a launcher sets, or None
    after saying on stderr what is missing or wrong (`plait COMMAND` then exits 2)."""
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    missing = [k for k, v in env.items() if not v]
    if missing:
        print(f"plait {command}: {', '.join(missing)} not set. Run it like the job: under torchrun, `plait testbed run "
              f"-- plait {command}`, or with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set on every machine; "
              f"or `plait {command} --local 3` for 3 ranks on this machine.", file=sys.stderr)
        return None
    try:
        rank, n, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError:
        print(f"plait {command}: RANK, WORLD_SIZE and MASTER_PORT must be integers", file=sys.stderr)
        return None
    if not 0 <= rank < n:
        print(f"plait {command}: RANK={rank} is not in [0, WORLD_SIZE={n})", file=sys.stderr)
        return None
    return rank, n, env["MASTER_ADDR"], port


def add_arguments(p):
    p.add_argument("--local", type=int, metavar="N", help="start N ranks on this machine (loopback) instead of "
                   "reading RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT")
    add_json_option(p, help="write the report as JSON to PATH (rank 0); `--json -` (or --json alone) prints it on "
                    "stdout instead of the tables")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds for connecting and for every measurement "
                   "step (default 30)")
    p.add_argument("--budget", type=float, default=0.25, help="seconds per bandwidth measurement (default 0.25)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth matrices")
    p.add_argument("--measure", action="store_true", help="have plait's start-up measure every link "
                   "(PLAIT_MEASURE=1, even for ranks on one host) and show that matrix: what the cost model and the "
                   "ring order use (shown anyway where start-up measures on its own: every rank on its own host)")


def main(args):
    if args.local is not None:
        if args.local < 2:
            print("plait doctor: --local needs at least 2 ranks", file=sys.stderr)
            return 2
        rest = (["--json", args.json] if args.json else []) + ["--timeout", str(args.timeout), "--budget", str(args.budget)] \
            + (["--no-bandwidth"] if args.no_bandwidth else []) + (["--measure"] if args.measure else [])
        return run_local(args.local, rest, args.timeout * 3 + 30)
    return run_as_job_rank("doctor", lambda rank, n, master_addr, port: run_rank(
        rank, n, master_addr, port, timeout=args.timeout, budget=args.budget, bandwidth=not args.no_bandwidth,
        json_path=args.json, measure=args.measure))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="plait doctor")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
