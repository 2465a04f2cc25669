"""Portability of the Python side: macOS Thunderbolt facts in `plait doctor`, process-group
helpers that work without POSIX process groups, the store on Windows, the MPS staging path, and
that nothing on the import / init / all_reduce path opens Linux-only files.

No Mac or Windows machine runs these: the macOS command output below is written in the formats
`networksetup` and `ifconfig` print on macOS 14/15 (Mac mini, three Thunderbolt ports), and the
platform-dependent branches are driven through their seams.
"""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from plait import _store
from plait.tools import _local, _thunderbolt, doctor

# -- captured-format samples ------------------------------------------------------------------------------
HARDWARE_PORTS = """
Hardware Port: Ethernet
Device: en0
Ethernet Address: 1c:f6:4c:7a:11:02

Hardware Port: Wi-Fi
Device: en1
Ethernet Address: 1c:f6:4c:7d:9a:3e

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: 36:02:a1:c8:9f:40

Hardware Port: Thunderbolt 1
Device: en2
Ethernet Address: 36:02:a1:c8:9f:40

Hardware Port: Thunderbolt 2
Device: en3
Ethernet Address: 36:02:a1:c8:9f:44

Hardware Port: Thunderbolt 3
Device: en4
Ethernet Address: 36:02:a1:c8:9f:48

VLAN Configurations
===================
"""

SERVICE_ORDER = """An asterisk (*) denotes that a network service is disabled.
(1) Ethernet
(Hardware Port: Ethernet, Device: en0)

(2) Wi-Fi
(Hardware Port: Wi-Fi, Device: en1)

(3) Thunderbolt Bridge
(Hardware Port: Thunderbolt Bridge, Device: bridge0)

"""

IFCONFIG_BRIDGE0 = """bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\toptions=63<RXCSUM,TXCSUM,TSO4,TSO6>
\tether 36:02:a1:c8:9f:40
\tConfiguration:
\t\tid 0:0:0:0:0:0 priority 0 hellotime 0 fwddelay 0
\t\tmaxage 0 holdcnt 0 proto stp maxaddr 100 timeout 1200
\t\troot id 0:0:0:0:0:0 priority 0 ifcost 0 port 0
\t\tipfilter disabled flags 0x0
\tmember: en2 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 10 priority 0 path cost 0
\tmember: en3 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 11 priority 0 path cost 0
\tmember: en4 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 12 priority 0 path cost 0
\tnd6 options=201<PERFORMNUD,DAD>
\tinet6 fe80::3402:a1ff:fec8:9f40%bridge0 prefixlen 64 secured scopeid 0x10
\tinet 169.254.41.7 netmask 0xffff0000 broadcast 169.254.255.255
\tmedia: <unknown type>
\tstatus: active
"""

# The same Mac after the fix: the bridge service disabled, a service per port.
SERVICE_ORDER_PER_PORT = """An asterisk (*) denotes that a network service is disabled.
(1) Ethernet
(Hardware Port: Ethernet, Device: en0)

(2) Wi-Fi
(Hardware Port: Wi-Fi, Device: en1)

(*) Thunderbolt Bridge
(Hardware Port: Thunderbolt Bridge, Device: bridge0)

(3) TB to mini-b
(Hardware Port: Thunderbolt 1, Device: en2)

(4) Thunderbolt 2
(Hardware Port: Thunderbolt 2, Device: en3)

"""

IFCONFIG_BRIDGE0_EMPTY = """bridge0: flags=8822<BROADCAST,SMART,SIMPLEX,MULTICAST> mtu 1500
\toptions=63<RXCSUM,TXCSUM,TSO4,TSO6>
\tether 36:02:a1:c8:9f:40
\tConfiguration:
\t\tid 0:0:0:0:0:0 priority 0 hellotime 0 fwddelay 0
\t\tmaxage 0 holdcnt 0 proto stp maxaddr 100 timeout 1200
\t\troot id 0:0:0:0:0:0 priority 0 ifcost 0 port 0
\t\tipfilter disabled flags 0x0
\tAddress cache:
\tnd6 options=201<PERFORMNUD,DAD>
\tmedia: <unknown type>
\tstatus: inactive
"""

IFCONFIG_ALL = """lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384
\toptions=1203<RXCSUM,TXCSUM,TXSTATUS,SW_TIMESTAMP>
\tinet 127.0.0.1 netmask 0xff000000
en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tether 1c:f6:4c:7a:11:02
\tinet 192.168.1.20 netmask 0xffffff00 broadcast 192.168.1.255
\tmedia: autoselect (1000baseT <full-duplex>)
\tstatus: active
""" + IFCONFIG_BRIDGE0 + """bridge1: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tmember: vmenet0 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 20 priority 0 path cost 0
utun0: flags=8051<UP,POINTOPOINT,RUNNING,MULTICAST> mtu 1380
"""


# -- parsing ------------------------------------------------------------------------------------------------
def test_parse_hardware_ports():
    ports = _thunderbolt.parse_hardware_ports(HARDWARE_PORTS)
    assert [(p["port"], p["device"]) for p in ports] == [
        ("Ethernet", "en0"), ("Wi-Fi", "en1"), ("Thunderbolt Bridge", "bridge0"),
        ("Thunderbolt 1", "en2"), ("Thunderbolt 2", "en3"), ("Thunderbolt 3", "en4")]
    assert ports[3]["mac"] == "36:02:a1:c8:9f:40"
    assert _thunderbolt.parse_hardware_ports("") == []
    # "N/A" addresses and a port without a device (seen for some adapters) are handled.
    odd = "Hardware Port: iPhone USB\nDevice: en8\nEthernet Address: N/A\n\nHardware Port: Broken\nDevice: \n"
    assert _thunderbolt.parse_hardware_ports(odd) == [{"port": "iPhone USB", "device": "en8", "mac": None}]


def test_parse_service_order():
    svcs = _thunderbolt.parse_service_order(SERVICE_ORDER_PER_PORT)
    by_dev = {s["device"]: s for s in svcs}
    assert by_dev["bridge0"] == {"service": "Thunderbolt Bridge", "port": "Thunderbolt Bridge", "device": "bridge0",
                                 "enabled": False}
    assert by_dev["en2"]["service"] == "TB to mini-b" and by_dev["en2"]["enabled"]
    assert by_dev["en3"]["service"] == "Thunderbolt 2"
    assert "en4" not in by_dev


def test_parse_bridge_members():
    assert _thunderbolt.parse_bridge_members(IFCONFIG_BRIDGE0) == {"bridge0": ["en2", "en3", "en4"]}
    assert _thunderbolt.parse_bridge_members(IFCONFIG_BRIDGE0_EMPTY) == {"bridge0": []}
    # The whole `ifconfig` listing: only bridges, each with its own members.
    assert _thunderbolt.parse_bridge_members(IFCONFIG_ALL) == {"bridge0": ["en2", "en3", "en4"], "bridge1": ["vmenet0"]}
    assert _thunderbolt.parse_bridge_members("ifconfig: interface bridge0 does not exist\n") == {}


def test_summarize_bridge_and_per_port():
    s = _thunderbolt.summarize(HARDWARE_PORTS, SERVICE_ORDER, IFCONFIG_BRIDGE0)
    assert s["bridges"] == [{"device": "bridge0", "port": "Thunderbolt Bridge", "service": "Thunderbolt Bridge",
                             "service_enabled": True, "members": ["en2", "en3", "en4"]}]
    assert [(p["port"], p["device"], p["service"], p["bridge"]) for p in s["ports"]] == [
        ("Thunderbolt 1", "en2", None, "bridge0"), ("Thunderbolt 2", "en3", None, "bridge0"),
        ("Thunderbolt 3", "en4", None, "bridge0")]
    s = _thunderbolt.summarize(HARDWARE_PORTS, SERVICE_ORDER_PER_PORT, IFCONFIG_BRIDGE0_EMPTY)
    assert s["bridges"][0]["members"] == [] and s["bridges"][0]["service_enabled"] is False
    assert [(p["device"], p["service"], p["bridge"]) for p in s["ports"]] == [
        ("en2", "TB to mini-b", None), ("en3", "Thunderbolt 2", None), ("en4", None, None)]
    # Commands that failed: nothing known, nothing invented.
    assert _thunderbolt.summarize("", "", "") == {"ports": [], "bridges": []}


def test_thunderbolt_info_runs_only_on_macos_with_timeouts():
    calls = []

    def fake_run(argv):
        calls.append(argv)
        if argv[-1] == "-listallhardwareports":
            return HARDWARE_PORTS, None
        if argv[-1] == "-listnetworkserviceorder":
            return "", "`networksetup -listnetworkserviceorder`: timed out after 3 seconds"
        if argv[-1] == "bridge0":
            return IFCONFIG_BRIDGE0, None
        raise AssertionError(argv)

    assert _thunderbolt.thunderbolt_info(platform="linux", run=fake_run) is None
    assert _thunderbolt.thunderbolt_info(platform="win32", run=fake_run) is None
    assert calls == []
    info = _thunderbolt.thunderbolt_info(platform="darwin", run=fake_run)
    assert [c[-1] for c in calls] == ["-listallhardwareports", "-listnetworkserviceorder", "bridge0"]
    assert info["bridges"][0]["members"] == ["en2", "en3", "en4"]
    assert len(info["ports"]) == 3 and info["errors"] and "timed out" in info["errors"][0]
    # The real runner: bounded, and a missing command is an error, not an exception.
    out, err = _thunderbolt._run(["/nonexistent/networksetup", "-listallhardwareports"])
    assert out == "" and err
    assert _thunderbolt.TIMEOUT <= 5
    # On this (Linux) machine, rank_info publishes the platform and no Thunderbolt facts.
    info = doctor.rank_info(0)
    assert info["platform"] == sys.platform and info["thunderbolt"] is None
    json.dumps(info)


# -- the doctor's warning ------------------------------------------------------------------------------------
LAN = {0: "192.168.1.20", 1: "192.168.1.21", 2: "192.168.1.22"}


def _mac_info(r, ifaces, tb):
    return {"rank": r, "host": f"mini-{'abc'[r]}", "host_resolves_to": [LAN[r]], "machine": f"boot-{r}/",
            "pid": 100 + r,
            "interfaces": [{"name": "lo0", "ip": "127.0.0.1", "prefix": 8, "mtu": 16384, "speed_mbps": None},
                           {"name": "en0", "ip": LAN[r], "prefix": 24, "mtu": 1500, "speed_mbps": 1000}] + ifaces,
            "env": {}, "platform": "darwin", "thunderbolt": tb}


def _measures(routes_by_rank, topology):
    return [{"routes": routes_by_rank[r], "topology": topology, "rtt": {}, "bandwidth": {}, "error": None,
             "stages_s": {}} for r in sorted(routes_by_rank)]


def _bridge_world():
    """Three Mac minis cabled as a triangle, the Thunderbolt Bridge left on (self-assigned
    169.254/16 addresses on bridge0, every port a bridge member)."""
    tb = _thunderbolt.summarize(HARDWARE_PORTS, SERVICE_ORDER, IFCONFIG_BRIDGE0)
    bip = {0: "169.254.41.7", 1: "169.254.9.88", 2: "169.254.200.3"}
    infos = [_mac_info(r, [{"name": "bridge0", "ip": bip[r], "prefix": 16, "mtu": 1500, "speed_mbps": None}], tb)
             for r in range(3)]
    routes = {r: [{"peer": p, "local": bip[r], "remote": bip[p], "local_iface": "bridge0",
                   "reason": "same subnet 169.254.0.0/16", "rtt_us": 80.0} for p in range(3) if p != r]
              for r in range(3)}
    return infos, _measures(routes, "shared_segment")


def _per_port_world():
    """The same triangle after the fix: one /24 per cable on the per-port interfaces, MTU and
    speed unknown (None) on the Thunderbolt ports."""
    tb = _thunderbolt.summarize(HARDWARE_PORTS, SERVICE_ORDER_PER_PORT, IFCONFIG_BRIDGE0_EMPTY)
    plan = {(0, 1): ("10.0.12", "en2", "en2"), (0, 2): ("10.0.13", "en3", "en2"), (1, 2): ("10.0.23", "en3", "en3")}
    ifaces = {r: [] for r in range(3)}
    addr = {}
    for (i, j), (net, di, dj) in plan.items():
        ifaces[i].append({"name": di, "ip": f"{net}.1", "prefix": 24, "mtu": None, "speed_mbps": None})
        ifaces[j].append({"name": dj, "ip": f"{net}.2", "prefix": 24, "mtu": None, "speed_mbps": None})
        addr[(i, j)], addr[(j, i)] = (f"{net}.1", di), (f"{net}.2", dj)
    infos = [_mac_info(r, ifaces[r], tb) for r in range(3)]
    routes = {r: [{"peer": p, "local": addr[(r, p)][0], "remote": addr[(p, r)][0], "local_iface": addr[(r, p)][1],
                   "reason": f"dedicated subnet {'.'.join(addr[(r, p)][0].split('.')[:3])}.0/24", "rtt_us": 60.0}
                  for p in range(3) if p != r] for r in range(3)}
    return infos, _measures(routes, "full_mesh")


def test_doctor_warns_about_the_thunderbolt_bridge_with_three_macs():
    infos, measures = _bridge_world()
    rep = doctor.build_report(3, infos, measures, [], master_addr="192.168.1.20", master_port=29500)
    tbw = [w for w in rep["warnings"] if w["code"] == "thunderbolt_bridge"]
    assert len(tbw) == 1, rep["warnings"]
    w = tbw[0]
    assert w["level"] == "warning" and w["ranks"] == [0, 1, 2]
    assert "bridge0" in w["message"] and "169.254.0.0/16" in w["message"]
    assert "ranks 0, 1, 2 the Thunderbolt ports en2, en3, en4 are members of bridge0" in w["message"]
    fix = w["fix"]
    assert 'sudo networksetup -setnetworkserviceenabled "Thunderbolt Bridge" off' in fix
    assert "sudo ifconfig bridge0 deletem en2" in fix
    # A service per port (none exist yet), then a distinct /24 per cable, both ends of each.
    assert 'sudo networksetup -createnetworkservice "Thunderbolt 1" "Thunderbolt 1"' in fix
    for line in ('sudo networksetup -setmanual "Thunderbolt 1" 10.0.12.1 255.255.255.0',   # rank 0 -> 1
                 'sudo networksetup -setmanual "Thunderbolt 2" 10.0.13.1 255.255.255.0',   # rank 0 -> 2
                 'sudo networksetup -setmanual "Thunderbolt 1" 10.0.12.2 255.255.255.0',   # rank 1 -> 0
                 'sudo networksetup -setmanual "Thunderbolt 2" 10.0.23.1 255.255.255.0',   # rank 1 -> 2
                 'sudo networksetup -setmanual "Thunderbolt 2" 10.0.23.2 255.255.255.0'):  # rank 2 -> 1
        assert line in fix, fix
    assert "the cable to rank 1, 10.0.12.0/24, on Thunderbolt 1 (en2):" in fix and "plait doctor" in fix
    # The rank sections come in order, each with its own commands.
    assert fix.index("rank 0 (mini-a):") < fix.index("rank 1 (mini-b):") < fix.index("rank 2 (mini-c):")
    # And the report prints (rich) with it.
    from rich.console import Console

    buf = io.StringIO()
    doctor.print_report(dict(rep, elapsed_s=1.0), Console(file=buf, width=160, force_terminal=False))
    out = buf.getvalue()
    assert "thunderbolt_bridge" in out and "-setnetworkserviceenabled" in out


def test_doctor_bridge_with_two_macs_is_a_note_and_ports_bridged_but_unused_is_a_warning():
    infos, measures = _bridge_world()
    infos2 = infos[:2]
    measures2 = [dict(m, routes=[r for r in m["routes"] if r["peer"] < 2]) for m in measures[:2]]
    rep = doctor.build_report(2, infos2, measures2, [])
    (w,) = [w for w in rep["warnings"] if w["code"] == "thunderbolt_bridge"]
    assert w["level"] == "note" and "10.0.12.1" in w["fix"]
    # (b) alone: the ports are bridge members, the bridge has no address, plait goes over en0.
    for info in infos:
        info["interfaces"] = [a for a in info["interfaces"] if a["name"] != "bridge0"]
    for r, m in enumerate(measures):
        m["routes"] = [{"peer": p, "local": LAN[r], "remote": LAN[p], "local_iface": "en0",
                        "reason": "same subnet 192.168.1.0/24", "rtt_us": 300.0} for p in range(3) if p != r]
    rep = doctor.build_report(3, infos, measures, [])
    (w,) = [w for w in rep["warnings"] if w["code"] == "thunderbolt_bridge"]
    assert w["level"] == "warning" and "are members of bridge0" in w["message"]
    assert "reach their peers" not in w["message"]
    assert 'sudo networksetup -setmanual "Thunderbolt 1" 10.0.12.1 255.255.255.0' in w["fix"]


def test_doctor_quiet_for_per_port_subnets_and_prints_unknown_speed_and_mtu():
    infos, measures = _per_port_world()
    rep = doctor.build_report(3, infos, measures, [], master_addr="192.168.1.20", master_port=29500)
    assert not [w for w in rep["warnings"] if w["code"] == "thunderbolt_bridge"], rep["warnings"]
    assert not [w for w in rep["warnings"] if w["level"] in ("warning", "error")], rep["warnings"]
    assert all(row["local_mtu"] is None for row in rep["routes"])
    from rich.console import Console

    buf = io.StringIO()
    doctor.print_report(dict(rep, elapsed_s=1.0), Console(file=buf, width=160, force_terminal=False))
    out = buf.getvalue()
    assert "10.0.12.1/24" in out and "no problems found" in out and "None" not in out
    json.dumps(rep)
    # One end's MTU known, the other's not: printed as such, no mismatch claimed.
    infos[0]["interfaces"][2]["mtu"] = 9000
    rep = doctor.build_report(3, infos, measures, [], master_addr="192.168.1.20", master_port=29500)
    assert not [w for w in rep["warnings"] if w["code"] == "mtu_mismatch"]
    buf = io.StringIO()
    doctor.print_report(dict(rep, elapsed_s=1.0), Console(file=buf, width=160, force_terminal=False))
    assert "9000/?" in buf.getvalue() and "None" not in buf.getvalue()


def test_doctor_does_not_call_loopback_a_fallback_for_ranks_on_one_host():
    """Two ranks of one host share the LAN subnet, which looks like a cable between just them;
    loopback is their best route. Unknown identities never count as one host."""
    def world(machine):
        infos = [dict(_mac_info(r, [], None), machine=machine(r)) for r in range(2)]
        for info in infos:  # both ranks on the same LAN address, as on one host
            info["interfaces"][1]["ip"] = LAN[0]
        routes = {r: [{"peer": 1 - r, "local": "127.0.0.1", "remote": "127.0.0.1", "local_iface": "lo0",
                       "reason": "same host", "rtt_us": 20.0}] for r in range(2)}
        rep = doctor.build_report(2, infos, _measures(routes, "shared_segment"), [])
        return [w["code"] for w in rep["warnings"]]

    assert "lan_fallback" not in world(lambda r: "boot-a/net:[1]")
    assert "lan_fallback" in world(lambda r: None)


def test_pair_subnets_avoid_networks_in_use():
    plan = _thunderbolt.pair_subnets([0, 1, 2])
    assert {k: (str(v[0]), str(v[1]), str(v[2])) for k, v in plan.items()} == {
        (0, 1): ("10.0.12.0/24", "10.0.12.1", "10.0.12.2"), (0, 2): ("10.0.13.0/24", "10.0.13.1", "10.0.13.2"),
        (1, 2): ("10.0.23.0/24", "10.0.23.1", "10.0.23.2")}
    plan = _thunderbolt.pair_subnets([0, 1, 2], taken=["10.0.0.0/16"])
    assert str(plan[(0, 1)][0]) == "10.1.2.0/24"
    plan = _thunderbolt.pair_subnets([0, 1, 2], taken=["10.0.0.0/8"])
    assert all(str(v[0]).startswith("172.31.") for v in plan.values())
    assert len({v[0] for v in _thunderbolt.pair_subnets(list(range(12))).values()}) == 66


def test_fix_commands_use_the_rank_platform():
    row_info = {"platform": "darwin"}
    assert doctor._cmd(row_info, "mtu", iface="en2", mtu=9000) == "sudo networksetup -setMTU en2 9000"
    assert doctor._cmd({"platform": "linux"}, "route", addr="10.0.12.2") == "ip route get 10.0.12.2"
    assert doctor._cmd(None, "links") == "ip link"
    assert doctor._cmd({"platform": "win32"}, "addrs") == "ipconfig"


# -- processes and the store --------------------------------------------------------------------------------
class _FakeProc:
    def __init__(self, running=True):
        self.pid = 4242
        self.running = running
        self.calls = []

    def poll(self):
        return None if self.running else 0

    def kill(self):
        self.calls.append("kill")
        self.running = False

    def terminate(self):
        self.calls.append("terminate")
        self.running = False

    def wait(self, timeout=None):
        return 0


def test_kill_group_without_process_groups(monkeypatch):
    """Windows: no os.killpg, no SIGKILL/SIGCONT: terminate()/kill() on the rank itself."""
    monkeypatch.setattr(_local, "POSIX_GROUPS", False)
    monkeypatch.delattr(signal, "SIGKILL", raising=False)
    monkeypatch.delattr(signal, "SIGCONT", raising=False)
    assert _local.popen_kwargs() == {}
    p = _FakeProc()
    _local.kill_group(p)
    assert p.calls == ["kill"]
    p = _FakeProc()
    _local.kill_group(p, signal.SIGTERM)
    assert p.calls == ["terminate"]
    p = _FakeProc(running=False)
    _local.kill_group(p)
    assert p.calls == []
    procs = [_FakeProc(), _FakeProc()]
    _local.stop_all(procs, term_wait=0.01)
    assert [q.calls for q in procs] == [["terminate"], ["terminate"]]


def test_kill_group_kills_the_whole_group_on_posix():
    if not _local.POSIX_GROUPS:
        pytest.skip("POSIX only")
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **_local.popen_kwargs())
    grandchild = int(p.stdout.readline())
    _local.stop_all([p], term_wait=5)
    assert p.returncode is not None
    p.stdout.close()

    def alive(pid):  # a zombie nobody has reaped yet counts as dead
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the rank's child survived stop_all"


def test_tcp_store_without_libuv_on_windows(monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    import inspect

    # The installed torch takes use_libuv (so the Windows branch passes a real argument).
    doc = dist.TCPStore.__init__.__doc__ or ""
    try:
        params = inspect.signature(dist.TCPStore.__init__).parameters
        assert "use_libuv" in params
    except (TypeError, ValueError):
        assert "use_libuv" in doc
    made = []
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: made.append((a, kw)) or "store")
    monkeypatch.setattr(sys, "platform", "win32")
    assert _store.tcp_store("127.0.0.1", 0, None, True, wait_for_workers=False) == "store"
    assert made[-1] == (("127.0.0.1", 0, None, True), {"wait_for_workers": False, "use_libuv": False})
    monkeypatch.setattr(sys, "platform", "darwin")
    _store.tcp_store("127.0.0.1", 5, 2, False)
    assert made[-1] == (("127.0.0.1", 5, 2, False), {})
    monkeypatch.setattr(sys, "platform", "linux")
    _store.tcp_store("h", 1, is_master=True)
    assert "use_libuv" not in made[-1][1]


def test_no_direct_tcpstore_or_killpg_outside_the_helpers():
    """Every store plait makes goes through _store.tcp_store; every local-rank kill through
    tools/_local.kill_group / stop_all (the testbed, Linux-only, may use process groups directly)."""
    import pathlib

    import plait

    root = pathlib.Path(plait.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        if rel == "_store.py":
            continue
        assert "TCPStore(" not in text, rel
        if rel == "tools/_local.py":
            continue
        if not rel.startswith("tools/testbed/") or rel == "tools/testbed/run.py":
            assert "killpg" not in text and "start_new_session=True" not in text, rel


def test_testbed_says_it_is_linux_only(monkeypatch):
    from plait.tools import testbed

    monkeypatch.setattr(sys, "platform", "darwin")
    why = testbed.check_can_build()
    assert why and "\n" not in why and "Linux-only" in why and "macOS" in why
    monkeypatch.setattr(sys, "platform", "win32")
    assert "Windows" in testbed.not_linux()
    with pytest.raises(testbed.TestbedError, match="Linux-only"):
        testbed.Testbed(3).up()

    from plait.tools import cli

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main(["testbed", "status"]) == 2
    out = err.getvalue()
    assert "Linux-only" in out and "Traceback" not in out

    # `plait demo`'s mesh act skips with that reason.
    from rich.console import Console

    from plait.tools import demo

    buf = io.StringIO()
    assert demo.mesh_act(Console(file=buf, width=200)) is None
    assert "mesh act skipped" in buf.getvalue() and "Linux-only" in buf.getvalue()


def test_sigterm_handler_without_sighup(monkeypatch):
    from plait.tools import cli

    monkeypatch.delattr(signal, "SIGHUP", raising=False)
    installed = []
    monkeypatch.setattr(signal, "signal", lambda s, h: installed.append(s))
    cli._sigterm_as_exit()
    assert installed == [signal.SIGTERM]


# -- MPS staging ----------------------------------------------------------------------------------------------
def test_staging_strategy_per_device():
    pytest.importorskip("torch")
    from plait.torch import staging as stg

    assert stg.strategy("cpu") == stg.Strategy(direct=True, pinned=False, cuda_stream=False, mps_sync=False)
    assert stg.strategy("cuda") == stg.Strategy(direct=False, pinned=True, cuda_stream=True, mps_sync=False)
    assert stg.strategy("mps") == stg.Strategy(direct=False, pinned=False, cuda_stream=False, mps_sync=True)
    assert stg.strategy("xpu") == stg.Strategy(direct=False, pinned=False, cuda_stream=False, mps_sync=False)


def test_mps_tensor_goes_through_plain_host_staging(monkeypatch):
    """An MPS tensor (a CPU tensor that reports device mps; there is no MPS here) is copied to a
    plain, unpinned host buffer, the core works on that, the result is copied back and
    torch.mps.synchronize() runs; nothing calls into torch.cuda, even where CUDA is present."""
    torch = pytest.importorskip("torch")
    from plait.torch import staging as stg

    def no_cuda(*a, **kw):
        raise AssertionError("torch.cuda called on the MPS path")

    for name in ("is_available", "current_stream", "stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    synced = []
    if not hasattr(torch, "mps"):
        monkeypatch.setattr(torch, "mps", types.SimpleNamespace(), raising=False)
    monkeypatch.setattr(torch.mps, "synchronize", lambda: synced.append(1), raising=False)
    real_empty = torch.empty
    pins = []

    def empty(*a, **kw):
        pins.append(kw.get("pin_memory", False))
        return real_empty(*a, **kw)

    monkeypatch.setattr(stg.torch, "empty", empty)

    class FakeMPS(torch.Tensor):
        @property
        def device(self):
            return torch.device("mps")

    t = torch.arange(6, dtype=torch.float32).as_subclass(FakeMPS)
    u = torch.zeros(4, dtype=torch.float32).as_subclass(FakeMPS)
    pool = stg.HostPool(1 << 20)
    st = stg.Staged(pool, force=False)
    assert not st.direct(t)
    h = st.host(t, read=True, write=True)
    assert type(h) is torch.Tensor and h.device.type == "cpu" and h.data_ptr() != t.data_ptr()
    assert h.tolist() == [0, 1, 2, 3, 4, 5]
    f = st.flat([u], read=False, write=True)
    h.mul_(10)  # "the op", on host memory
    f.fill_(7)
    assert t.tolist() == [0, 1, 2, 3, 4, 5]  # not yet copied back
    st.finish()
    assert t.tolist() == [0, 10, 20, 30, 40, 50] and u.tolist() == [7, 7, 7, 7]
    assert synced == [1]
    assert pins and not any(pins), pins  # plain host memory
    st.finish()  # idempotent
    assert synced == [1]
    # The buffers went back to the pool, as plain ones, and are reused.
    (key,) = {k for k in pool._free}
    assert key[1] is False
    st2 = stg.Staged(pool, force=False)
    st2.host(t, read=True, write=False)
    st2.finish()
    assert synced == [1]  # nothing written back: no sync needed


def test_cuda_tensors_still_ask_for_pinned_buffers(monkeypatch):
    torch = pytest.importorskip("torch")
    from plait.torch import staging as stg

    pool = stg.HostPool(1 << 20)
    asked = []
    monkeypatch.setattr(pool, "acquire", lambda n, pinned=False: asked.append(pinned) or (torch.empty(
        stg._next_pow2(n), dtype=torch.uint8), False))
    monkeypatch.setattr(stg, "_stream_ctx", lambda t: None)

    class FakeCUDA(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda")

    class FakeMPS(torch.Tensor):
        @property
        def device(self):
            return torch.device("mps")

    st = stg.Staged(pool, force=False)
    st.host(torch.ones(3).as_subclass(FakeCUDA), read=True, write=False)
    st.host(torch.ones(3).as_subclass(FakeMPS), read=True, write=False)
    st.host(torch.ones(3), read=True, write=False)  # contiguous CPU: in place, no buffer
    st.finish()
    assert asked == [True, False]
    # Without CUDA a pinned request gets a plain buffer (and never asks torch for pinned memory).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real_empty, kws = torch.empty, []
    monkeypatch.setattr(stg.torch, "empty", lambda *a, **kw: kws.append(kw) or real_empty(*a, **kw))
    buf, pinned = stg.HostPool(1 << 20).acquire(100, pinned=True)
    assert pinned is False and buf.numel() >= 100 and not any(kw.get("pin_memory") for kw in kws)


# -- nothing Linux-only on the import / init / all_reduce path ------------------------------------------------
AUDIT = textwrap.dedent("""
    import datetime, json, os, sys
    import torch, torch.distributed as dist  # torch's own import reads /proc/self/maps: not plait's

    seen, spawned = [], []

    def hook(event, args):
        if event in ("open", "os.listdir", "os.scandir") and args and args[0] is not None \\
                and not isinstance(args[0], int):
            p = os.fsdecode(args[0])
            if p.startswith(("/proc", "/sys")):
                seen.append(p)
        elif event in ("subprocess.Popen", "os.posix_spawn", "os.exec", "os.system"):
            spawned.append(repr(args)[:200])

    sys.addaudithook(hook)
    import plait
    import plait.torch
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("plait", store=store, rank=0, world_size=1)
    t = torch.full((1000,), 3.0)
    dist.all_reduce(t)
    assert t.eq(3.0).all()
    x = torch.ones(4, 6)[:, 1]  # not contiguous: the staging path
    dist.all_reduce(x, async_op=True).wait()
    dist.barrier()
    dist.destroy_process_group()
    ours, ours_spawned = list(seen), list(spawned)
    try:  # the hook works: this one must be seen
        open("/proc/self/stat").close()
    except OSError:
        pass
    print(json.dumps({"paths": ours, "spawned": ours_spawned, "control": seen[len(ours):]}))
""")


def test_import_and_init_open_nothing_under_proc_or_sys():
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", AUDIT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["control"] == ["/proc/self/stat"]
    assert res["paths"] == [], res["paths"]
    assert res["spawned"] == [], res["spawned"]


WINDOWS_LIKE = textwrap.dedent("""
    import os, signal, subprocess, sys
    # What Windows lacks, removed before plait is imported.
    for name in ("killpg", "setsid", "getpgid", "geteuid", "fork"):
        if hasattr(os, name):
            delattr(os, name)
    for name in ("SIGKILL", "SIGHUP", "SIGCONT", "SIGSTOP"):
        if hasattr(signal, name):
            delattr(signal, name)
    import rich.console  # noqa: F401  (imported as on Linux: it has its own Windows console code)
    sys.platform = "win32"
    import plait, plait.tools.cli, plait.tools.demo, plait.tools.bench, plait.tools.doctor, plait.tools.demo_ddp
    import plait.tools.testbed, plait.tools.testbed.run
    from plait.tools import _local
    assert _local.popen_kwargs() == {}
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **_local.popen_kwargs())
    _local.stop_all([p], term_wait=5)
    assert p.returncode is not None, p.returncode
    assert plait.tools.testbed.check_can_build().startswith("the testbed is Linux-only")
    assert plait.tools.cli.main(["testbed", "status"]) == 2
    plait.tools.cli._sigterm_as_exit()
    print("ok")
""")


def test_modules_import_and_stop_ranks_without_posix_process_groups():
    p = subprocess.run([sys.executable, "-c", WINDOWS_LIKE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-2000:] + p.stderr[-4000:]
    assert "Linux-only" in p.stderr


def test_doctor_names_the_pair_that_cannot_connect_even_when_another_rank_quotes_it_first():
    """A rank whose peer failed to connect may report that peer's error ("peer rank 2 (...) failed:
    could not connect to rank 1"): the unreachable pair is still 2 and 1, not the quoting rank."""
    infos, measures = _per_port_world()
    relayed = ("allreduce #0: peer rank 2 (10.0.13.2:40000) failed: rendezvous: could not connect to rank 1 (mini-b): "
               "10.0.23.2 -> 10.0.23.1: timed out")
    measures[0] = {"error": {"type": "PeerError", "message": relayed, "stage": "connect"}}
    measures[2] = {"error": {"type": "RendezvousError", "message": "rendezvous: could not connect to rank 1 (mini-b): timed out",
                             "stage": "connect"}}
    rep = doctor.build_report(3, infos, measures, [])
    culprits = [w for w in rep["warnings"] if w["code"] == "unreachable_peer"]
    assert [w["ranks"] for w in culprits] == [[1, 2]], culprits
    assert "rank 2 cannot reach rank 1" in culprits[0]["message"]
