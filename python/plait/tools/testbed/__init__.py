"""A direct-cabled mesh on one machine, for plait's tests, benchmarks and demo.

`Testbed(n)` builds n network namespaces ("nodes") `<name>-0` ... `<name>-<n-1>`:

- a "cable" for every pair of nodes i < j: a veth pair in its own /24, `10.<i+1>.<j+1>.0/24`, where
  node i is `10.<i+1>.<j+1>.<i+1>` and node j is `10.<i+1>.<j+1>.<j+1>`. Inside node i the cable to
  node j is the interface `mesh<j>`. Both ends are rate-limited with `tc ... tbf` at `link_rate`.
- WAN cables (`wan=`, see plait.tools.testbed.wan): the cables named there instead get a one-way
  delay, a rate and optionally a loss rate per direction. Each is a TUN device at each end, with the
  same name and addresses as a veth cable, and a forwarder process (`_wan_forwarder.py`, one per
  cable, living in node i's namespace) that holds every packet for the delay and paces it to the
  rate. The nodes of such a testbed get TCP buffer limits (tcp_rmem/tcp_wmem max) that fit the
  largest bandwidth-delay product, or (`tcp_buffers="stock"`) the limits a stock Linux install
  has, 6 MiB and 4 MiB, that one stream cannot fill a long fat cable with (or `tcp_buffers=N`
  bytes).
- a shared, slower "office LAN": a bridge in its own namespace `<name>-lan`, one port per node,
  `10.99.0.0/24` (node i is `10.99.0.<i+1>`, interface `lan0`), rate-limited at `lan_rate` in both
  directions of every port (a switch with `lan_rate` ports).
- loopback up everywhere; each node has a hostname `<name>-<i>` (set for commands started with
  `run`/`popen`) that resolves to its LAN address, like a machine on an office network. That is
  what gloo and other hostname-based tools will pick.

Nothing is created in the root namespace except the namespaces themselves and their
`/etc/netns/<ns>/hosts` files (and a WAN testbed's forwarder logs next to its state file). What
was created (namespaces, files, forwarder processes) is recorded in `/run/plait-testbed/<name>.json`
*before* it is created, so `down()` (or `plait testbed down`) removes exactly that, even after a
crash half-way through `up()`. Needs root.

    with Testbed(3, link_rate="1gbit", lan_rate="100mbit") as tb:
        res = tb.run([sys.executable, "-c", "import os; print(os.environ['RANK'])"], timeout=30)

    with Testbed(3, wan="0-1 40ms 200mbit, 1-2 5ms 1gbit, 0-2 80ms 50mbit") as tb: ...
"""

import atexit
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

STATE_DIR = Path("/run/plait-testbed")
NETNS_ETC = Path("/etc/netns")
LAN_PREFIX = "10.99.0"
NODE_PREFIX = "10.200.0"  # /32 "node" addresses, used only by the gloo workaround in the benchmark
MAX_NODES = 16
_CMD_TIMEOUT = 20.0  # seconds for one `ip`/`tc` command
VETH_SPEED_MBPS = 10000  # what a veth end reports as its speed; a WAN cable's TUN ends report the same


class TestbedError(RuntimeError):
    """A testbed could not be built, found or removed; the message says what to do."""

    __test__ = False  # not a pytest test class


# -- rates -----------------------------------------------------------------------------------------
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(rate):
    """`1gbit`, `100mbit`, `2.5gbit`, or a number of bits per second -> bits per second (int).
    None, 0, "0", "none", "unlimited", "" -> None (no shaping)."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        return int(rate) if rate > 0 else None
    s = str(rate).strip().lower()
    if s in ("", "0", "none", "unlimited", "off"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", s)
    if not m or (m.group(2) or "bit") not in _UNITS:
        raise TestbedError(f"rate {rate!r}: use a number with a unit in bits per second, such as 1gbit, 100mbit "
                           "or 2.5gbit, or 'none' for no limit")
    bps = int(float(m.group(1)) * _UNITS[m.group(2) or "bit"])
    if bps <= 0:
        return None
    if bps < 100_000:
        raise TestbedError(f"rate {rate!r} is below 100kbit, too slow for anything useful")
    return bps


def format_rate(bps):
    if bps is None:
        return "unlimited"
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= f:
            v = bps / f
            return f"{v:g}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{bps}bit"


def _tbf(bps):
    """tc tbf arguments for a rate: a burst of ~2 ms of traffic (at least 64 KiB so that TSO
    frames pass whole), a 50 ms queue."""
    burst = max(64 * 1024, int(bps / 8 * 0.002))
    return ["tbf", "rate", f"{bps}bit", "burst", str(burst), "latency", "50ms"]


# -- names and addresses ---------------------------------------------------------------------------
def cable_subnet(i, j):
    a, b = sorted((i, j))
    return f"10.{a + 1}.{b + 1}.0/24"


def cable_addr(i, j):
    """Node i's address on the cable to node j."""
    a, b = sorted((i, j))
    return f"10.{a + 1}.{b + 1}.{i + 1}"


def cable_iface(i, j):
    """The name, inside node i, of the cable to node j."""
    return f"mesh{j}"


def lan_addr(i):
    return f"{LAN_PREFIX}.{i + 1}"


def node_addr(i):
    return f"{NODE_PREFIX}.{i + 1}"


LAN_IFACE = "lan0"
LAN_SUBNET = f"{LAN_PREFIX}.0/24"


def _check_name(name):
    if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", name or ""):
        raise TestbedError(f"testbed name {name!r}: use 1 to 12 lower-case letters and digits, starting with a letter")
    return name


def _state_path(name):
    return STATE_DIR / f"{name}.json"


def _run(cmd, check=True):
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=_CMD_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(cmd)}` did not finish within {_CMD_TIMEOUT:.0f} s") from None
    except FileNotFoundError:
        raise TestbedError(f"`{cmd[0]}` not found: install iproute2 (apt-get install iproute2)") from None
    if check and p.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {(p.stderr or p.stdout).strip()}")
    return p


def existing_namespaces():
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def not_linux():
    """None on Linux, else the one-line reason the testbed cannot run on this system."""
    if sys.platform.startswith("linux"):
        return None
    system = {"darwin": "macOS", "win32": "Windows", "cygwin": "Windows (Cygwin)"}.get(sys.platform, sys.platform)
    return (f"the testbed is Linux-only (it builds network namespaces with `ip netns` and `tc`); this is {system}. "
            "Everything else in plait works here; to check real links run `plait doctor` on the machines")


def check_can_build():
    """None if this process can build a testbed, else the reason (one line)."""
    why = not_linux()
    if why:
        return why
    if os.geteuid() != 0:
        return "the testbed needs root (it creates network namespaces); run it with sudo"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2 util-linux)"
    p = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        return f"`ip netns` does not work here: {p.stderr.strip()}"
    return None


def list_testbeds():
    """States of the testbeds that are up (from /run/plait-testbed)."""
    out = []
    if STATE_DIR.is_dir():
        for p in sorted(STATE_DIR.glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                pass
    return out


class Testbed:
    """n nodes joined by a cable per pair (or only the pairs in `links`) and a shared LAN.

    link_rate / lan_rate: tc rates ("1gbit", "100mbit") or None for unlimited.
    mtu: MTU of every cable end (default 1500). mtu_ends: {(i, j): mtu} for node i's end of the
    cable to node j only (to build an MTU mismatch). links: the pairs that get a cable (default
    every pair: a full mesh). node_addrs: also give each node a /32 address 10.200.0.<i+1> on its
    loopback, with host routes to every other node's over the cables (the manual workaround other
    libraries need; see resolve_hostnames and plait.tools.testbed.bench). wan: cables with a delay,
    rate and loss per direction, e.g. "0-1 40ms 200mbit, 1-2 5ms 1gbit" (the syntax, a file form and
    the defaults are in plait.tools.testbed.wan); the other cables stay veth pairs at link_rate.
    """

    __test__ = False

    def __init__(self, nodes, *, link_rate="1gbit", lan_rate="100mbit", name="plaitbed", mtu=None,
                 mtu_ends=None, links=None, node_addrs=False, wan=None, tcp_buffers="fit"):
        self.name = _check_name(name)
        if tcp_buffers not in ("fit", "stock") and not (isinstance(tcp_buffers, int) and tcp_buffers >= 4096):
            raise TestbedError(f"tcp_buffers must be 'fit', 'stock' or a number of bytes (at least 4096), got {tcp_buffers!r}")
        self.tcp_buffers = tcp_buffers
        self.n = int(nodes)
        if not 2 <= self.n <= MAX_NODES:
            raise TestbedError(f"--nodes must be between 2 and {MAX_NODES}, got {nodes}")
        self.link_bps = parse_rate(link_rate)
        self.lan_bps = parse_rate(lan_rate)
        self.mtu = int(mtu) if mtu else None
        self.mtu_ends = {tuple(k): int(v) for k, v in (mtu_ends or {}).items()}
        if links is None:
            links = [(i, j) for i in range(self.n) for j in range(i + 1, self.n)]
        self.links = sorted({tuple(sorted((int(a), int(b)))) for a, b in links})
        for a, b in self.links:
            if a == b or not (0 <= a < self.n and 0 <= b < self.n):
                raise TestbedError(f"link {a}-{b}: nodes are 0..{self.n - 1} and a link joins two different nodes")
        for (i, j), m in self.mtu_ends.items():
            if tuple(sorted((i, j))) not in self.links:
                raise TestbedError(f"mtu for {i}:{j}: there is no cable between nodes {i} and {j}")
            if not 68 <= m <= 65535:
                raise TestbedError(f"mtu {m} is out of range (68..65535)")
        self.node_addrs = bool(node_addrs)
        try:
            cables = _wan.parse_wan(wan)
        except _wan.WanSpecError as e:
            raise TestbedError(str(e)) from None
        for a, b in cables:
            if not (0 <= a < self.n and 0 <= b < self.n):
                raise TestbedError(f"WAN cable {a}-{b}: nodes are 0..{self.n - 1}")
            if (a, b) not in self.links:
                raise TestbedError(f"WAN cable {a}-{b}: there is no cable between nodes {a} and {b} (see --links)")
        self.wan = _wan.resolve(cables, self.link_bps)
        self._procs = []
        self._state = None
        self._atexit = False
        self._lock = threading.Lock()

    # -- names -------------------------------------------------------------------------------------
    def ns(self, i):
        return f"{self.name}-{i}"

    @property
    def lan_ns(self):
        return f"{self.name}-lan"

    def hostname(self, i):
        return self.ns(i)

    @property
    def namespaces(self):
        return [self.ns(i) for i in range(self.n)]

    @property
    def master_addr(self):
        return lan_addr(0)

    def peers(self, i):
        return [j for j in range(self.n) if j != i and tuple(sorted((i, j))) in self.links]

    @property
    def full_mesh(self):
        return len(self.links) == self.n * (self.n - 1) // 2

    def wan_directions(self, i, j):
        """(Direction i->j, Direction j->i) of the WAN cable i-j, or None for a veth cable."""
        d = self.wan.get((min(i, j), max(i, j)))
        if d is None:
            return None
        return d if i < j else (d[1], d[0])

    def describe(self):
        """A JSON-able description: nodes, their interfaces and addresses."""
        nodes = []
        for i in range(self.n):
            cables = []
            for j in self.peers(i):
                c = {"peer": j, "iface": cable_iface(i, j), "addr": cable_addr(i, j), "subnet": cable_subnet(i, j),
                     "peer_addr": cable_addr(j, i), "mtu": self.mtu_ends.get((i, j), self.mtu or 1500)}
                w = self.wan_directions(i, j)
                if w:
                    c["wan"] = dict(w[0].to_json(), text=_wan.describe_direction(w[0]))
                cables.append(c)
            nodes.append({"node": i, "namespace": self.ns(i), "hostname": self.hostname(i), "lan": lan_addr(i),
                          "node_addr": node_addr(i) if self.node_addrs else None, "cables": cables})
        return {"name": self.name, "nodes": self.n, "link_rate_bps": self.link_bps, "lan_rate_bps": self.lan_bps,
                "links": [list(x) for x in self.links], "master_addr": self.master_addr, "lan_subnet": LAN_SUBNET,
                "wan": _wan.to_json(self.wan), "node_list": nodes}

    # -- build and remove --------------------------------------------------------------------------
    def up(self):
        """Builds the testbed; on any failure removes what it built and raises TestbedError."""
        why = check_can_build()
        if why:
            raise TestbedError(f"cannot build the testbed: {why}")
        if _state_path(self.name).exists():
            raise TestbedError(f"a testbed named {self.name!r} is already up (state in {_state_path(self.name)}); "
                               f"remove it with `plait testbed down --name {self.name}` or pick another --name")
        ours = set(self.namespaces) | {self.lan_ns}
        clash = [ns for ns in existing_namespaces() if ns in ours]
        if clash:
            raise TestbedError(f"network namespace(s) {', '.join(clash)} already exist but no testbed state records "
                               f"them; remove them with `plait testbed down --name {self.name} --force`")
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self._state = dict(self.describe(), pid=os.getpid(), created=time.time(), namespaces=[], files=[], dirs=[],
                           forwarders=[], mtu=self.mtu, mtu_ends=[[i, j, m] for (i, j), m in self.mtu_ends.items()],
                           node_addrs=self.node_addrs)
        self._save()
        if not self._atexit:
            atexit.register(self._down_at_exit)
            self._atexit = True
        try:
            self._build()
        except BaseException:
            try:
                self.down()
            except Exception as e:  # report the original error; the cleanup problem goes to stderr
                print(f"plait testbed: cleanup after a failed start also failed: {e}", file=sys.stderr)
            raise
        return self

    def _save(self):
        tmp = _state_path(self.name).with_suffix(".tmp")
        tmp.write_text(json.dumps(self._state, indent=1))
        os.replace(tmp, _state_path(self.name))

    def _add_ns(self, ns):
        self._state["namespaces"].append(ns)  # recorded first: a crash right after still cleans it
        self._save()
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self):
        n = self.n
        for i in range(n):
            self._add_ns(self.ns(i))
        self._add_ns(self.lan_ns)
        # Cables first, so that they are listed before the LAN inside each node.
        for i, j in self.links:
            a, b = cable_iface(i, j), cable_iface(j, i)
            wan = (i, j) in self.wan
            if wan:  # a TUN device at each end; the forwarder started below joins them
                for node, dev in ((i, a), (j, b)):
                    _run(["ip", "-n", self.ns(node), "tuntap", "add", "dev", dev, "mode", "tun", "vnet_hdr"])
            else:
                _run(["ip", "-n", self.ns(i), "link", "add", a, "type", "veth", "peer", "name", b, "netns",
                      self.ns(j)])
            for node, other, dev in ((i, j, a), (j, i, b)):
                ns = self.ns(node)
                mtu = self.mtu_ends.get((node, other), self.mtu)
                if mtu:
                    _run(["ip", "-n", ns, "link", "set", dev, "mtu", str(mtu)])
                _run(["ip", "-n", ns, "addr", "add", f"{cable_addr(node, other)}/24", "dev", dev])
                if self.link_bps and not wan:
                    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root"] + _tbf(self.link_bps))
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
        lan = self.lan_ns
        _run(["ip", "-n", lan, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", lan, "link", "set", "br0", "up"])
        for i in range(n):
            ns, port = self.ns(i), f"port{i}"
            _run(["ip", "-n", ns, "link", "add", LAN_IFACE, "type", "veth", "peer", "name", port, "netns", lan])
            _run(["ip", "-n", ns, "addr", "add", f"{lan_addr(i)}/24", "dev", LAN_IFACE])
            if self.lan_bps:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", LAN_IFACE, "root"] + _tbf(self.lan_bps))
                _run(["tc", "-n", lan, "qdisc", "add", "dev", port, "root"] + _tbf(self.lan_bps))
            _run(["ip", "-n", lan, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", lan, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "link", "set", LAN_IFACE, "up"])
        if self.node_addrs:
            for i in range(n):
                ns = self.ns(i)
                _run(["ip", "-n", ns, "addr", "add", f"{node_addr(i)}/32", "dev", "lo"])
                for j in self.peers(i):
                    _run(["ip", "-n", ns, "route", "add", f"{node_addr(j)}/32", "via", cable_addr(j, i),
                          "dev", cable_iface(i, j), "src", node_addr(i)])
        # Hostnames that resolve to the LAN address, as on an office network.
        if not NETNS_ETC.exists():
            self._state["dirs"].append(str(NETNS_ETC))
            self._save()
            NETNS_ETC.mkdir(parents=True)
        for i in range(n):
            d = NETNS_ETC / self.ns(i)
            self._state["dirs"].insert(0, str(d))
            self._state["files"].append(str(d / "hosts"))
            self._save()
            d.mkdir(exist_ok=True)
        self.resolve_hostnames("lan")
        if self.wan:
            self._tcp_buffers()
            for i, j in sorted(self.wan):
                self._start_forwarder(i, j)
            self._wait_forwarders()
        self._wait_links()

    def _tcp_buffers(self):
        """Every node's TCP autotuning may grow a socket's buffers to 4x the largest bandwidth-delay
        product (+ queue) of the WAN cables: a stream fills a long fat cable without setting
        SO_SNDBUF/SO_RCVBUF. With tcp_buffers="stock", the nodes get a stock Linux kernel's limits
        instead (what most users' machines have); with a number, that maximum (a default no larger).
        (tcp_rmem/tcp_wmem are per namespace; the root namespace is untouched.)"""
        for which in ("tcp_rmem", "tcp_wmem"):
            if self.tcp_buffers == "stock":
                value = _wan.STOCK_TCP_BUFFERS[which]
            elif isinstance(self.tcp_buffers, int):
                value = f"4096 {min(self.tcp_buffers, 131072)} {self.tcp_buffers}"
            else:
                try:
                    lo, default, hi = (int(x) for x in Path(f"/proc/sys/net/ipv4/{which}").read_text().split())
                except (OSError, ValueError):
                    lo, default, hi = 4096, 131072, 0
                value = f"{lo} {default} {_wan.tcp_buffer_max(self.wan, hi)}"
            for i in range(self.n):
                _run(["ip", "netns", "exec", self.ns(i), "sh", "-c", f'echo "$0" > /proc/sys/net/ipv4/{which}', value])

    def _start_forwarder(self, i, j):
        ij, ji = self.wan[(i, j)]
        log = STATE_DIR / f"{self.name}-wan-{i}-{j}.log"
        self._state["files"].append(str(log))
        self._save()
        cfg = {"testbed": self.name, "a": {"ns": self.ns(i), "dev": cable_iface(i, j)},
               "b": {"ns": self.ns(j), "dev": cable_iface(j, i)}, "ab": ij.to_json(), "ba": ji.to_json(),
               "seed": random.randrange(1 << 30), "speed_mbps": VETH_SPEED_MBPS}
        with open(log, "wb") as f:
            p = subprocess.Popen([sys.executable, str(_wan.FORWARDER), json.dumps(cfg)], stdin=subprocess.DEVNULL,
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        self._procs.append(p)
        self._state["forwarders"].append({"pid": p.pid, "start": _proc_start(p.pid), "link": [i, j],
                                          "log": str(log)})
        self._save()

    def resolve_hostnames(self, to="lan"):
        """What each node's hostname resolves to, for commands started from now on: "lan" (its
        LAN address, the default, like an office network) or "node" (its /32 node address;
        needs node_addrs=True)."""
        if to not in ("lan", "node") or (to == "node" and not self.node_addrs):
            raise TestbedError(f"resolve_hostnames({to!r}): use 'lan', or 'node' on a testbed built with node_addrs")
        addr = lan_addr if to == "lan" else node_addr
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{addr(i)} {self.hostname(i)}\n" for i in range(self.n))
        for i in range(self.n):
            (NETNS_ETC / self.ns(i) / "hosts").write_text(hosts)

    def _wait_forwarders(self, timeout=10.0):
        """Until every forwarder says it is ready (both ends attached, offloads and speed set)."""
        deadline = time.monotonic() + timeout
        for fw in self._state["forwarders"]:
            while True:
                try:
                    log = Path(fw["log"]).read_text()
                except OSError:
                    log = ""
                if '{"ready": true' in log:
                    break
                cable = f"{fw['link'][0]}-{fw['link'][1]}"
                if _proc_start(fw["pid"]) != fw["start"] or _reaped(self._procs, fw["pid"]):
                    raise TestbedError(f"the WAN forwarder of cable {cable} exited:\n{log[-2000:]}")
                if time.monotonic() > deadline:
                    raise TestbedError(f"the WAN forwarder of cable {cable} was not ready within {timeout:.0f} s:\n"
                                       f"{log[-2000:]}")
                time.sleep(0.02)

    def _wait_links(self, timeout=10.0):
        """Until every interface reports LOWER_UP (veth carrier comes up asynchronously; a TUN end
        once its forwarder has attached to it)."""
        deadline = time.monotonic() + timeout
        for i in range(self.n):
            while True:
                p = _run(["ip", "-n", self.ns(i), "-o", "link", "show", "up"], check=False)
                want = [cable_iface(i, j) for j in self.peers(i)] + [LAN_IFACE]
                ok = all(re.search(rf"\b{w}(@\S+)?: <[^>]*LOWER_UP", p.stdout) for w in want)
                if ok:
                    break
                if time.monotonic() > deadline:
                    raise TestbedError(f"the interfaces of {self.ns(i)} did not come up within {timeout:.0f} s:\n"
                                       f"{p.stdout}")
                time.sleep(0.05)

    def down(self):
        """Removes everything recorded in the state file (idempotent)."""
        state = self._state
        if state is None:
            try:
                state = json.loads(_state_path(self.name).read_text())
            except (OSError, ValueError):
                return
        teardown(state)
        self._state = None
        for p in self._procs:  # reap the forwarders this process started (teardown killed them)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []

    def _down_at_exit(self):
        if self._state is not None:
            try:
                self.down()
            except Exception as e:
                print(f"plait testbed: removing {self.name!r} at exit failed: {e}", file=sys.stderr)

    def __enter__(self):
        if self._state is None:
            self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    @classmethod
    def attach(cls, name="plaitbed"):
        """The testbed `name` that is already up (built by `plait testbed up`)."""
        _check_name(name)
        try:
            state = json.loads(_state_path(name).read_text())
        except FileNotFoundError:
            raise TestbedError(f"no testbed named {name!r} is up: start one with `plait testbed up --nodes 3"
                               + ("" if name == "plaitbed" else f" --name {name}") + "`") from None
        except (OSError, ValueError) as e:
            raise TestbedError(f"cannot read the state of testbed {name!r} ({_state_path(name)}): {e}") from None
        tb = cls(state["nodes"], name=name, link_rate=state["link_rate_bps"], lan_rate=state["lan_rate_bps"],
                 mtu=state.get("mtu"), mtu_ends={(i, j): m for i, j, m in state.get("mtu_ends", [])},
                 links=state["links"], node_addrs=state.get("node_addrs", False), wan=state.get("wan") or None)
        tb._attached = state
        return tb

    # -- running commands ----------------------------------------------------------------------------
    def env(self, rank, master_port, extra=None, per_node=1):
        """torchrun's environment for `rank` of `per_node` processes on each node: ranks
        node * per_node .. node * per_node + per_node - 1 run on one node, as torchrun numbers them."""
        node = rank // per_node
        env = dict(os.environ)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.n * per_node), LOCAL_RANK=str(rank % per_node),
                   LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(node),
                   MASTER_ADDR=self.master_addr, MASTER_PORT=str(master_port), PLAIT_TESTBED=self.name,
                   PLAIT_TESTBED_NODE=str(node), PYTHONUNBUFFERED="1")
        if extra:
            env.update({k: str(v) for k, v in extra.items()})
        return env

    def wrap(self, i, cmd):
        """argv that runs cmd inside node i, with the node's hostname."""
        return ["ip", "netns", "exec", self.ns(i), "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.hostname(i)] + list(cmd)

    def popen(self, i, cmd, env=None, **kw):
        """subprocess.Popen of cmd inside node i, in its own session (kill with killpg)."""
        kw.setdefault("start_new_session", True)
        return subprocess.Popen(self.wrap(i, cmd), env=env if env is not None else self.env(i, free_port()), **kw)

    def run(self, cmd, *, timeout=600.0, env=None, rank_env=None, master_port=None, stream=True, out=None,
            grace=10.0, ranks=None, per_node=1):
        """Runs cmd `per_node` times per node in parallel with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
        (node 0's LAN address) and MASTER_PORT set. `cmd` is an argv list, or a function rank -> argv.
        Output lines are prefixed with the rank and streamed to `out` (stdout) when `stream`.
        When a rank fails the others get `grace` seconds to finish, then are killed. Returns a
        RunResult; every process is dead afterwards (also on KeyboardInterrupt)."""
        return run_ranks(self, cmd, timeout=timeout, env=env, rank_env=rank_env, master_port=master_port,
                         stream=stream, out=out, grace=grace, ranks=ranks, per_node=per_node)

    def set_cable(self, i, j, up):
        """Takes the cable between nodes i and j down (node i's end; the peer sees no carrier) or up.
        On a WAN cable the forwarder mirrors the state as the peer's carrier within 0.1 s and drops
        what was in flight to the end that is down."""
        _run(["ip", "-n", self.ns(i), "link", "set", cable_iface(i, j), "up" if up else "down"])


def teardown(state):
    """Removes what a state record lists: kills processes left in its namespaces, deletes them,
    removes its files, then the state file."""
    errors = []
    for fw in state.get("forwarders", []):
        if fw.get("start") is not None and _proc_start(fw["pid"]) == fw["start"]:
            try:
                os.kill(fw["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    for ns in reversed(state.get("namespaces", [])):
        p = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for pid in p.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if ns in existing_namespaces():
            r = subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if r.returncode != 0:
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
    for f in state.get("files", []):
        try:
            os.unlink(f)
        except FileNotFoundError:
            pass
        except OSError as e:
            errors.append(f"{f}: {e}")
    for d in state.get("dirs", []):
        try:
            os.rmdir(d)
        except (FileNotFoundError, OSError):
            pass  # not empty: someone else's files are in it
    if errors:
        raise TestbedError("could not remove everything: " + "; ".join(errors))
    try:
        _state_path(state["name"]).unlink()
    except FileNotFoundError:
        pass


def down(name="plaitbed", force=False):
    """Removes testbed `name`. Returns a list of what was removed (for the CLI)."""
    _check_name(name)
    path = _state_path(name)
    if path.exists():
        try:
            state = json.loads(path.read_text())
        except ValueError:
            state = None
        if state is not None:
            teardown(state)
            return state.get("namespaces", [])
    strays = [ns for ns in existing_namespaces() if re.fullmatch(rf"{re.escape(name)}-(\d+|lan)", ns)]
    if strays and not force:
        raise TestbedError(f"no state recorded for testbed {name!r}, but namespaces {', '.join(strays)} exist; "
                           f"remove them with `plait testbed down --name {name} --force`")
    if strays:
        teardown({"name": name, "namespaces": strays,  # (WAN forwarders live in node namespaces: killed too)
                  "files": [str(NETNS_ETC / ns / "hosts") for ns in strays]
                  + [str(p) for p in STATE_DIR.glob(f"{name}-wan-*.log")],
                  "dirs": [str(NETNS_ETC / ns) for ns in strays] + [str(NETNS_ETC)]})
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    return strays


def _proc_start(pid):
    """The start time of process pid (clock ticks since boot), or None if there is none: with the
    pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _reaped(procs, pid):
    """Whether one of our own child processes with this pid has exited."""
    return any(p.pid == pid and p.poll() is not None for p in procs)


def free_port():
    """A port for MASTER_PORT. Inside a fresh namespace nothing listens, and ports below the
    ephemeral range (32768) are never handed out for outgoing connections."""
    return random.randrange(20000, 32000)


from .run import RunResult, run_ranks  # noqa: E402  (run.py uses the names above)
from . import wan as _wan  # noqa: E402

__all__ = ["Testbed", "TestbedError", "RunResult", "check_can_build", "not_linux", "down", "list_testbeds",
           "parse_rate", "format_rate", "cable_addr", "cable_iface", "cable_subnet", "lan_addr", "node_addr", "LAN_IFACE",
           "LAN_SUBNET", "free_port"]
