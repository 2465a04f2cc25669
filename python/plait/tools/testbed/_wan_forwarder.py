"""The testbed's WAN delay line: one process per delayed cable (Linux only, standard library only).

Started by `plait.tools.testbed.Testbed` (see `plait.tools.testbed.wan` for the spec, the defaults
and the docs) as `python _wan_forwarder.py CONFIG_JSON`. The cable's two ends are persistent TUN
devices that the testbed made in the two nodes' namespaces (`mesh<j>` in node i, `mesh<i>` in node
j, with the addresses a veth cable would have). This process

1. enters node j's namespace, attaches to its TUN device, enters node i's namespace, attaches to
   that one, and stays in node i's namespace (so `ip netns pids` lists it and the testbed's teardown
   kills it even without its state record);
2. turns on the TUN offloads (checksum, TSO4/6, with a virtio-net header per packet), so TCP hands
   it 64 KiB segments while the MTU stays 1500: about 2,000 packets a second carry 1 Gbit/s;
3. for each direction, models one bottleneck router port: a packet read at time t that finds the
   port busy until `busy` starts serialising at max(t, busy), takes (wire bytes * 8 / rate) seconds,
   and is written into the other end `delay` seconds after its last bit left; a packet that would
   find more than `queue` bytes ahead of it is dropped (tail drop); with `loss` p a packet that
   carries k TCP segments is dropped with probability 1 - (1 - p)^k (all k at once);
4. mirrors the administrative state of each end as the other end's carrier (like a veth pair), and
   drops what is due for an end that is down;
5. writes one JSON line of counters to stdout (the testbed's log file) on SIGUSR1 and SIGTERM.
"""

import ctypes
import fcntl
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUNSETCARRIER = 0x400454E2
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
SIOCGIFFLAGS, SIOCETHTOOL = 0x8913, 0x8946
ETHTOOL_GSET, ETHTOOL_SSET = 1, 2
CLONE_NEWNET = 0x40000000
PR_SET_TIMERSLACK = 29
VNET = 10  # sizeof(struct virtio_net_hdr)
READ_MAX = 65600  # a virtio-net header and the largest IPv4 packet (64 KiB)
BURST = 64  # packets read from one end per wake-up, at most
FLAGS_EVERY = 0.1  # seconds between checks of the ends' up/down state

_libc = ctypes.CDLL(None, use_errno=True)


def setns(ns):
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns into {ns}: {os.strerror(e)}")
    finally:
        os.close(fd)


def ifreq(name, tail=b""):
    return struct.pack("16s", name.encode()) + tail.ljust(24, b"\0")


def open_tun(dev):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.ioctl(fd, TUNSETIFF, ifreq(dev, struct.pack("H", IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    return fd


def is_up(sock, dev):
    r = fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, ifreq(dev))
    return bool(struct.unpack_from("H", r, 16)[0] & 1)


def set_carrier(fd, on):
    fcntl.ioctl(fd, TUNSETCARRIER, struct.pack("i", 1 if on else 0))


def set_speed(sock, dev, mbps):
    """What the end reports as its link speed (/sys/class/net/<dev>/speed). A TUN device says
    10 Mbit/s unless told otherwise; the testbed makes it say what a veth cable says."""
    buf = ctypes.create_string_buffer(44)  # struct ethtool_cmd
    req = ifreq(dev, struct.pack("P", ctypes.addressof(buf)))
    struct.pack_into("I", buf, 0, ETHTOOL_GSET)
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, req)
    struct.pack_into("I", buf, 0, ETHTOOL_SSET)
    struct.pack_into("H", buf, 12, mbps & 0xFFFF)
    struct.pack_into("H", buf, 28, mbps >> 16)
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, req)


def wire(pkt):
    """(bytes the packet takes on a wire of MTU-sized segments, number of segments): a TSO packet of
    k segments carries its IP and TCP headers k times (as tc counts a GSO packet)."""
    n = len(pkt) - VNET
    gso_type = pkt[1] & 0x7F
    if gso_type == 0 or n <= 0:
        return n, 1
    gso_size = pkt[4] | (pkt[5] << 8)
    if gso_size == 0:
        return n, 1
    v = pkt[VNET] >> 4
    l3 = (pkt[VNET] & 15) * 4 if v == 4 else 40
    if gso_type in (1, 4) and len(pkt) > VNET + l3 + 12:  # TCPv4, TCPv6
        hdr = l3 + (pkt[VNET + l3 + 12] >> 4) * 4
    else:
        hdr = l3 + 8
    segs = max(1, -(-(n - hdr) // gso_size))
    return n + (segs - 1) * hdr, segs


class Direction:
    """One direction of the cable: a bottleneck port (rate, queue, loss) and then a delay."""

    def __init__(self, src, dst, cfg):
        self.src, self.dst = src, dst
        self.delay = float(cfg.get("delay") or 0.0)
        rate = cfg.get("rate")
        self.byte_time = 8.0 / float(rate) if rate else 0.0  # seconds per byte; 0: unlimited
        self.loss = float(cfg.get("loss") or 0.0)
        self.queue = int(cfg.get("queue") or 0)  # bytes; 0: no limit
        self.busy = 0.0  # when the port finishes what it holds
        self.q = deque()  # (time due at the far end, packet)
        self.dst_up = True
        self.n_in = self.b_in = self.n_out = self.b_out = 0
        self.drop_queue = self.drop_loss = self.drop_down = self.drop_write = 0
        self.max_backlog = 0

    def take(self, now):
        """Reads what the source end has sent (at most BURST packets)."""
        src, q, delay, byte_time, loss, queue = self.src, self.q, self.delay, self.byte_time, self.loss, self.queue
        for _ in range(BURST):
            try:
                pkt = os.read(src, READ_MAX)
            except BlockingIOError:
                return
            except OSError:
                return
            size, segs = wire(pkt)
            self.n_in += 1
            self.b_in += size
            if loss and random.random() < 1.0 - (1.0 - loss) ** segs:
                self.drop_loss += 1
                continue
            if byte_time:
                start = self.busy if self.busy > now else now
                backlog = (start - now) / byte_time  # bytes ahead of this packet
                if queue and backlog > 0 and backlog + size > queue:
                    self.drop_queue += 1
                    continue
                if backlog > self.max_backlog:
                    self.max_backlog = backlog
                self.busy = start + size * byte_time
                q.append((self.busy + delay, pkt))
            else:
                q.append((now + delay, pkt))

    def deliver(self, now):
        q, dst = self.q, self.dst
        while q and q[0][0] <= now:
            pkt = q.popleft()[1]
            if not self.dst_up:
                self.drop_down += 1
                continue
            try:
                os.write(dst, pkt)
                self.n_out += 1
                self.b_out += len(pkt) - VNET
            except OSError:
                self.drop_write += 1

    def stats(self):
        return {"in_packets": self.n_in, "in_bytes": self.b_in, "out_packets": self.n_out, "out_bytes": self.b_out,
                "dropped_queue": self.drop_queue, "dropped_loss": self.drop_loss, "dropped_down": self.drop_down,
                "dropped_write": self.drop_write, "max_backlog_bytes": int(self.max_backlog), "queued": len(self.q)}


def main():
    cfg = json.loads(sys.argv[1])
    a, b = cfg["a"], cfg["b"]  # a: node i's end (mesh<j>), b: node j's end (mesh<i>)
    random.seed(cfg.get("seed"))
    setns(b["ns"])
    fd_b = open_tun(b["dev"])
    sock_b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    setns(a["ns"])
    fd_a = open_tun(a["dev"])
    sock_a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for sock, dev in ((sock_a, a["dev"]), (sock_b, b["dev"])):
        try:
            set_speed(sock, dev, int(cfg.get("speed_mbps", 10000)))
        except OSError as e:
            print(f"wan forwarder: could not set the link speed of {dev}: {e}", flush=True)
    try:
        _libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake-ups within a microsecond, not 50
        os.setpriority(os.PRIO_PROCESS, 0, int(cfg.get("nice", -10)))
    except OSError:
        pass
    ab = Direction(fd_a, fd_b, cfg["ab"])
    ba = Direction(fd_b, fd_a, cfg["ba"])
    by_fd = {fd_a: ab, fd_b: ba}
    dirs = (ab, ba)
    carrier = {fd_a: True, fd_b: True}
    want = {"stats": False, "exit": False}

    def on_signal(signum, frame):
        want["stats"] = True
        if signum == signal.SIGTERM:
            want["exit"] = True

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(json.dumps({"ready": True, "pid": os.getpid(), "a": a, "b": b, "ab": cfg["ab"], "ba": cfg["ba"]}),
          flush=True)
    t0 = time.process_time()
    mono = time.monotonic
    begun = mono()
    next_flags = begun
    rlist = [fd_a, fd_b]
    sel = select.select
    while True:
        now = mono()
        due = next_flags
        for d in dirs:
            if d.q and d.q[0][0] < due:
                due = d.q[0][0]
        timeout = due - now
        r = sel(rlist, (), (), timeout if timeout > 0 else 0)[0]
        now = mono()
        for fd in r:
            by_fd[fd].take(now)
        for d in dirs:
            if d.q and d.q[0][0] <= now:
                d.deliver(now)
        if now >= next_flags:
            next_flags = now + FLAGS_EVERY
            try:
                up_a, up_b = is_up(sock_a, a["dev"]), is_up(sock_b, b["dev"])
            except OSError:
                up_a = up_b = False
            ab.dst_up, ba.dst_up = up_b, up_a
            for fd, on in ((fd_b, up_a), (fd_a, up_b)):  # each end's carrier is the other end's state
                if carrier[fd] != on:
                    try:
                        set_carrier(fd, on)
                        carrier[fd] = on
                    except OSError:
                        pass
            if want["stats"]:
                want["stats"] = False
                print(json.dumps({"t": round(now - begun, 3), "cpu_s": round(time.process_time() - t0, 3),
                                  "ab": ab.stats(), "ba": ba.stats()}), flush=True)
                if want["exit"]:
                    return 0


if __name__ == "__main__":
    sys.exit(main())
