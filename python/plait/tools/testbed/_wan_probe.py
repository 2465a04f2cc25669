"""Probes for checking a testbed cable, run inside a node (standard library only; ping needs root).

    python _wan_probe.py ping ADDR COUNT INTERVAL_S [WAIT_S] -> {"rtt_ms": [...], "lost": n}
    python _wan_probe.py sink ADDR PORT SECONDS          -> prints {"listening": true}, then
                                                           {"samples": [[t, bytes], ...]} (t from the first byte)
    python _wan_probe.py source ADDR PORT SECONDS [CC]   -> {"sent": bytes} (CC: congestion control,
                                                           e.g. cubic; default the node's, bbr here)

ping sends ICMP echo requests of 64 bytes (like ping(8)) from a raw socket, one at a time, each
waiting for its reply (or WAIT_S, default 2 s). The TCP stream uses the system's buffer autotuning (no
SO_SNDBUF/SO_RCVBUF), so it shows what an ordinary program gets from the node's tcp_rmem/tcp_wmem.
"""

import json
import os
import socket
import struct
import sys
import time


def _csum(b):
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def ping(addr, count, interval, wait=2.0):
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xFFFF
    rtts, lost = [], 0
    for seq in range(int(count)):
        payload = struct.pack("!d", time.monotonic()).ljust(56, b"p")
        hdr = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
        pkt = struct.pack("!BBHHH", 8, 0, _csum(hdr + payload), ident, seq) + payload
        t0 = time.monotonic()
        s.sendto(pkt, (addr, 0))
        deadline = t0 + wait
        got = None
        while got is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            s.settimeout(left)
            try:
                data = s.recv(2048)
            except socket.timeout:
                break
            t1 = time.monotonic()
            ihl = (data[0] & 15) * 4
            typ, _code, _c, rid, rseq = struct.unpack_from("!BBHHH", data, ihl)
            if typ == 0 and rid == ident and rseq == seq:
                got = t1 - t0
        if got is None:
            lost += 1
        else:
            rtts.append(got * 1e3)
        spent = time.monotonic() - t0
        if spent < interval:
            time.sleep(interval - spent)
    return {"rtt_ms": rtts, "lost": lost}


def sink(addr, port, seconds):
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, int(port)))
    ls.listen(1)
    print(json.dumps({"listening": True}), flush=True)
    ls.settimeout(30)
    c, _ = ls.accept()
    buf = bytearray(1 << 20)
    total, samples, t0 = 0, [], None
    next_sample = 0.0
    c.settimeout(5)
    while True:
        try:
            n = c.recv_into(buf)
        except socket.timeout:
            break
        if n == 0:
            break
        now = time.monotonic()
        if t0 is None:
            t0 = now
        total += n
        last = now
        if now - t0 >= next_sample:
            samples.append([round(now - t0, 4), total])
            next_sample = now - t0 + 0.05
    if t0 is not None:
        samples.append([round(last - t0, 4), total])  # the last byte (not the close after it)
    return {"samples": samples}


def source(addr, port, seconds, cc=None):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if cc:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
    s.settimeout(10)
    s.connect((addr, int(port)))
    chunk = memoryview(bytes(1 << 20))
    sent, end = 0, time.monotonic() + float(seconds)
    while time.monotonic() < end:
        s.sendall(chunk)
        sent += len(chunk)
    s.shutdown(socket.SHUT_WR)
    s.close()
    return {"sent": sent}


def main():
    what, args = sys.argv[1], sys.argv[2:]
    if what == "ping":
        out = ping(args[0], int(args[1]), float(args[2]), *(float(a) for a in args[3:4]))
    elif what == "sink":
        out = sink(args[0], args[1], float(args[2]))
    elif what == "source":
        out = source(args[0], args[1], float(args[2]), args[3] if len(args) > 3 else None)
    else:
        raise SystemExit(f"unknown probe {what!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
