"""Thunderbolt on macOS, for `plait doctor`.

macOS gives every Thunderbolt port its own BSD network device (`en1`, `en2`, ..., hardware ports
"Thunderbolt 1", "Thunderbolt 2", ...) and, by default, joins them all into the "Thunderbolt
Bridge" (`bridge0`): one interface, one subnet for every cable. With two Macs that works; with three
or more cabled as a mesh, plait cannot tell the cables apart (every peer is on the same subnet, on
the same interface) and bridge0 forwards frames between its ports, so traffic between two Macs may
be relayed through a third. What plait wants is one subnet per cable, on the per-port interfaces.

Each rank learns its facts with `thunderbolt_info()` (macOS only: `networksetup` and `ifconfig`,
each bounded by a short timeout) and publishes them in the doctor's rank info; rank 0 turns them
into a warning with the commands that fix it (`check`). The parsers are pure functions of the
commands' text, tested with captured output formats.
"""

import ipaddress
import re
import subprocess
import sys

TIMEOUT = 3.0  # seconds per command
NETWORKSETUP = "/usr/sbin/networksetup"
IFCONFIG = "/sbin/ifconfig"
BRIDGE_SERVICE = "Thunderbolt Bridge"


# -- parsing (pure) -------------------------------------------------------------------------------------
def parse_hardware_ports(text):
    """`networksetup -listallhardwareports` -> [{"port": "Thunderbolt 1", "device": "en1",
    "mac": "36:..."}], in the order listed (the "VLAN Configurations" tail is ignored)."""
    out, cur = [], None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Hardware Port:"):
            cur = {"port": line.split(":", 1)[1].strip(), "device": None, "mac": None}
            out.append(cur)
        elif cur is not None and line.startswith("Device:"):
            cur["device"] = line.split(":", 1)[1].strip() or None
        elif cur is not None and line.startswith("Ethernet Address:"):
            mac = line.split(":", 1)[1].strip()
            cur["mac"] = None if mac in ("", "N/A") else mac
        elif line.startswith("VLAN Configurations"):
            cur = None
    return [p for p in out if p["device"]]


def parse_service_order(text):
    """`networksetup -listnetworkserviceorder` -> [{"service": "Thunderbolt 1", "port":
    "Thunderbolt 1", "device": "en1", "enabled": True}]. A disabled service is listed as
    `(*) Name`."""
    out, cur = [], None
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"^\((\d+|\*)\)\s+(.*)$", line)
        if m and not line.startswith("(Hardware Port:"):
            cur = {"service": m.group(2).strip(), "port": None, "device": None, "enabled": m.group(1) != "*"}
            out.append(cur)
            continue
        m = re.match(r"^\(Hardware Port:\s*(.*?),\s*Device:\s*(.*?)\)$", line)
        if m and cur is not None:
            cur["port"] = m.group(1).strip()
            cur["device"] = m.group(2).strip() or None
            cur = None
    return out


def parse_bridge_members(text):
    """`ifconfig bridge0` (or the whole `ifconfig` listing) -> {"bridge0": ["en1", "en2"]}: every
    `bridgeN:` block with its `member:` lines, in order."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z][\w.]*\d+): flags=", line)
        if m:
            cur = m.group(1) if m.group(1).startswith("bridge") else None
            if cur is not None:
                out.setdefault(cur, [])
            continue
        if cur is not None:
            m = re.match(r"^\s+member:\s+(\S+)", line)
            if m:
                out[cur].append(m.group(1))
    return out


def summarize(hardware_ports_text, service_order_text, bridges_text):
    """The facts a rank publishes, from the three commands' text (any may be "", e.g. a
    command that failed): {"ports": [{"port", "device", "service", "bridge"}], "bridges":
    [{"device", "service", "members"}]}. `ports` are the Thunderbolt ports (not the bridge);
    `service` is the network service on that device (None: there is none yet), `bridge` the
    bridge it is a member of (None: not bridged)."""
    hw = parse_hardware_ports(hardware_ports_text or "")
    services = {}
    for s in parse_service_order(service_order_text or ""):
        if s["device"]:
            services.setdefault(s["device"], s)
    members = parse_bridge_members(bridges_text or "")
    bridge_of = {m: b for b, ms in members.items() for m in ms}
    bridges, ports = [], []
    for p in hw:
        dev = p["device"]
        svc = services.get(dev)
        if dev.startswith("bridge"):
            bridges.append({"device": dev, "port": p["port"], "service": svc["service"] if svc else None,
                            "service_enabled": svc["enabled"] if svc else None, "members": members.get(dev, [])})
        elif p["port"].lower().startswith("thunderbolt"):
            ports.append({"port": p["port"], "device": dev, "service": svc["service"] if svc else None,
                          "bridge": bridge_of.get(dev)})
    for b, ms in members.items():  # a bridge networksetup does not list (made with ifconfig)
        if not any(x["device"] == b for x in bridges):
            bridges.append({"device": b, "port": None, "service": None, "service_enabled": None, "members": ms})
    return {"ports": ports, "bridges": bridges}


# -- collecting (each rank, macOS only) -------------------------------------------------------------------
def _run(argv):
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.SubprocessError) as e:
        return "", f"`{' '.join(argv)}`: {e}"
    if p.returncode != 0:
        return p.stdout, f"`{' '.join(argv)}` exited with {p.returncode}: {p.stderr.strip()[:200]}"
    return p.stdout, None


def thunderbolt_info(platform=None, run=_run):
    """This machine's Thunderbolt ports and bridges (see `summarize`), plus "errors" (commands
    that failed or timed out); None when not on macOS."""
    if (platform or sys.platform) != "darwin":
        return None
    errors = []
    hw, err = run([NETWORKSETUP, "-listallhardwareports"])
    errors += [err] if err else []
    order, err = run([NETWORKSETUP, "-listnetworkserviceorder"])
    errors += [err] if err else []
    text = []
    for p in parse_hardware_ports(hw):
        if p["device"].startswith("bridge"):
            out, err = run([IFCONFIG, p["device"]])
            errors += [err] if err else []
            text.append(out)
    info = summarize(hw, order, "\n".join(text))
    info["errors"] = errors
    return info


# -- analysis (rank 0, pure) ----------------------------------------------------------------------------
def _net(a):
    try:
        return ipaddress.ip_interface(f"{a['ip']}/{a['prefix']}").network
    except (ValueError, KeyError, TypeError):
        return None


def _bridges(info):
    """{bridge device: its record} of a rank (by name on a Mac that published no details)."""
    tb = info.get("thunderbolt") or {}
    out = {b["device"]: b for b in tb.get("bridges") or []}
    if not tb and info.get("platform") == "darwin":
        for a in info.get("interfaces", []):
            if re.match(r"^bridge\d+$", a["name"]):
                out.setdefault(a["name"], {"device": a["name"], "service": None, "members": []})
    return out


def pair_subnets(ranks, taken=()):
    """A /24 per pair of `ranks` (sorted), avoiding the networks in `taken`: {(i, j): (network,
    address of i, address of j)}. Up to 9 ranks: pair i < j is 10.0.<i+1><j+1>.0/24 (ranks 0
    and 1: 10.0.12.0/24, rank 0 .1, rank 1 .2), else 10.<i+1>.<j+1>.0/24; 172.31.x.0/24 when those
    clash with a network in use."""
    ranks = sorted(ranks)
    pairs = [(a, b) for k, a in enumerate(ranks) for b in ranks[k + 1:]]
    taken = [ipaddress.ip_network(t) for t in taken]

    def schemes():
        if len(ranks) <= 9 and max(ranks, default=0) <= 8:
            yield lambda i, j: f"10.0.{10 * (i + 1) + (j + 1)}.0/24"
        if max(ranks, default=0) < 254:
            yield lambda i, j: f"10.{i + 1}.{j + 1}.0/24"
        yield lambda i, j, _k={p: k for k, p in enumerate(pairs)}: f"172.31.{_k[(i, j)] % 256}.0/24"

    for f in schemes():
        plan = {}
        for i, j in pairs:
            net = ipaddress.ip_network(f(i, j))
            plan[(i, j)] = (net, net.network_address + 1, net.network_address + 2)
        if not any(net.overlaps(t) for net, _, _ in plan.values() for t in taken if t.version == 4):
            return plan
    return plan


def check(n, infos, rows, warn):
    """Warns (through doctor's `warn(level, code, message, fix, ranks)`) when a rank (a) reaches
    peers over a Thunderbolt Bridge address, or (b) has Thunderbolt ports that are bridge
    members; the fix is the commands that give every cable its own subnet instead."""
    via_bridge = {}  # rank -> (bridge device, its networks, peers reached over it)
    bridged = {}  # rank -> (bridge device, [bridged Thunderbolt ports])
    for r, info in enumerate(infos):
        if not info:
            continue
        bridges = _bridges(info)
        if not bridges:
            continue
        nets = {}
        for a in info.get("interfaces", []):
            net = _net(a)
            if a["name"] in bridges and net is not None and not net.is_loopback and not (
                    net.version == 6 and net.is_link_local):  # fe80::/64 is on every interface
                nets.setdefault(a["name"], set()).add(net)
        peers = set()
        dev = None
        for row in rows:
            if row["from"] == r and row.get("local_iface") in bridges:
                peers.add(row["to"])
                dev = row["local_iface"]
        for d, ns in nets.items():
            for j, other in enumerate(infos):
                if j == r or not other:
                    continue
                if any(_net(a) in ns for a in other.get("interfaces", [])):
                    peers.add(j)
                    dev = dev or d
        if peers:
            via_bridge[r] = (dev, sorted(str(x) for x in nets.get(dev, ())), sorted(peers))
        tb = info.get("thunderbolt") or {}
        ports = [p for p in tb.get("ports") or [] if p.get("bridge")]
        if ports:
            bridged[r] = (ports[0]["bridge"], ports)
    if not via_bridge and not bridged:
        return
    affected = sorted(set(via_bridge) | set(bridged) | {p for _, _, ps in via_bridge.values() for p in ps})
    parts = []
    if via_bridge:
        devs = sorted({d for d, _, _ in via_bridge.values()})
        nets = sorted({x for _, ns, _ in via_bridge.values() for x in ns})
        parts.append(f"ranks {', '.join(map(str, sorted(via_bridge)))} reach their peers over the Thunderbolt Bridge "
                     f"({', '.join(devs)}" + (f", {', '.join(nets)}" if nets else "") + "): macOS joins every "
                     "Thunderbolt port into that one interface and subnet, so plait cannot tell the cables apart, "
                     "and with 3 or more Macs the bridge may relay one pair's traffic through a third Mac, "
                     "sharing its cables")
    if bridged:
        same = {}
        for r, (b, ports) in sorted(bridged.items()):
            same.setdefault((b, ", ".join(p["device"] for p in ports)), []).append(r)
        parts.append("; ".join(f"on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} the Thunderbolt ports "
                               f"{devs} are members of {b}" for (b, devs), rs in same.items())
                     + " (plait wants each port as its own interface, one subnet per cable)")
    level = "warning" if n >= 3 or (bridged and not via_bridge) else "note"
    warn(level, "thunderbolt_bridge", "; ".join(parts), fix_commands(infos, affected), affected)


def _q(s):
    return '"' + s.replace('"', '\\"') + '"'


def fix_commands(infos, ranks):
    """The commands, per rank, that turn a Thunderbolt Bridge set-up into one subnet per cable."""
    taken = []
    for info in infos:
        bridges = _bridges(info or {})
        for a in (info or {}).get("interfaces", []):
            net = _net(a)
            if net is not None and a["name"] not in bridges and not net.is_loopback and not net.is_link_local:
                taken.append(net)
    plan = pair_subnets(ranks, taken)
    lines = ["on each Mac, turn the Thunderbolt Bridge off and give every Thunderbolt port cabled to a peer its own "
             "subnet (one /24 per cable; the address plan below puts pair i-j on its own network):"]
    for r in ranks:
        info = infos[r] if r < len(infos) else None
        if not info:
            continue
        tb = info.get("thunderbolt") or {}
        head = f"rank {r} ({info.get('host', '?')}):"
        if info.get("platform") not in (None, "darwin"):
            peers = [((min(r, p), max(r, p)), p) for p in ranks if p != r]
            lines.append(head + " (not a Mac) " + "; ".join(
                f"for the cable to rank {p}: address {plan[k][1] if r == k[0] else plan[k][2]}/24" for k, p in peers))
            continue
        lines.append(head)
        for b in _bridges(info).values():
            svc = b.get("service") or BRIDGE_SERVICE
            lines.append(f"  sudo networksetup -setnetworkserviceenabled {_q(svc)} off")
            for m in b.get("members") or []:
                lines.append(f"  sudo ifconfig {b['device']} deletem {m}")
        ports = list(tb.get("ports") or [])
        peers = [p for p in ranks if p != r]
        for k, p in enumerate(peers):
            i, j = min(r, p), max(r, p)
            net, ai, aj = plan[(i, j)]
            addr = ai if r == i else aj
            # (No inline `# comments`: zsh, macOS's shell, does not take them on the command line.)
            if k < len(ports):
                port = ports[k]
                svc = port.get("service") or port["port"]
                lines.append(f" the cable to rank {p}, {net}, on {port['port']} ({port['device']}):")
                if not port.get("service"):
                    lines.append(f"  sudo networksetup -createnetworkservice {_q(svc)} {_q(port['port'])}")
                lines.append(f"  sudo networksetup -setmanual {_q(svc)} {addr} 255.255.255.0")
            else:
                lines.append(f" the cable to rank {p}, {net}, on the port it is plugged into:")
                lines.append(f"  sudo networksetup -setmanual \"Thunderbolt {k + 1}\" {addr} 255.255.255.0")
    lines.append("ports are matched to peers in order; if rank i's cable to rank j is in another port, put that "
                 "address on that port's service instead (`ifconfig enN` shows `status: active` on a cabled port; "
                 "`networksetup -listallhardwareports` maps ports to enN). Then run `plait doctor` again: every pair "
                 "should route over its own subnet. If bridge0 comes back after a restart, delete the Thunderbolt "
                 "Bridge service in System Settings > Network.")
    return "\n".join(lines)
