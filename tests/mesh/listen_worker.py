"""Helpers of test_listen.py, run inside a testbed node: `python listen_worker.py <role> [json args]`.

- `ranks`: a world of 2 ranks on threads of this process, meeting in an in-process store. Rank 0
  starts alone and its listening port is printed ('@@{"port": P}'); rank 1 starts when a line
  arrives on stdin; then '@@{"ok": bool, "error": str}' and the exit.
- `stranger`: connects to args["addr"]:args["port"], optionally sends a hello claiming to be rank 1,
  prints '@@{"connect": "ok" | error}', then everything it read ('@@{"read": hex, "end": why}').
"""

import json
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def emit(**ev):
    sys.stdout.write("@@" + json.dumps(ev) + "\n")
    sys.stdout.flush()


def ranks(args):
    import numpy as np

    import plait
    from kvstore import KVServer

    store = KVServer()
    comms, errors = [None, None], []

    def build(r):
        try:
            # The allreduce below runs on other threads than the ones that build the communicators.
            comms[r] = plait.Communicator(store, r, 2, timeout=args.get("timeout", 20), threads="sequential")
        except Exception as e:
            errors.append(f"rank {r}: {e}")

    t0 = threading.Thread(target=build, args=(0,), daemon=True)
    t0.start()
    store.wait(["plait/default/0/rank/0"], 20)
    emit(port=json.loads(store.get("plait/default/0/rank/0"))["port"])
    sys.stdin.readline()
    t1 = threading.Thread(target=build, args=(1,), daemon=True)
    t1.start()
    t0.join(60)
    t1.join(60)
    ok = not errors and all(comms)
    if ok:
        out = [None, None]

        def run(r):
            out[r] = comms[r].allreduce(np.full(3, r + 1, np.int32))

        ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        ok = all(o is not None and o.tolist() == [3, 3, 3] for o in out)
    emit(ok=ok, error="; ".join(errors))
    for c in comms:
        if c is not None:
            c.close()


def hello(group="default", epoch=0, frm=1, to=0, world=2):
    """A hello as net/handshake.rs writes it (version 3: lane 0 of 1, no token, frames not sealed).
    A stranger cannot go further: the Noise message that follows needs the rank's key."""
    g = group.encode()
    return (b"PLAITHS" + bytes([3]) + epoch.to_bytes(8, "little") + frm.to_bytes(4, "little")
            + to.to_bytes(4, "little") + world.to_bytes(4, "little") + bytes([0, 1, 0]) + len(g).to_bytes(2, "little") + g)


def stranger(args):
    try:
        s = socket.create_connection((args["addr"], args["port"]), timeout=5)
    except OSError as e:
        emit(connect=f"{type(e).__name__}: {e}")
        return
    emit(connect="ok")
    if args.get("hello"):
        s.sendall(hello())
    s.settimeout(args.get("read_for", 10))
    got, end = b"", "eof"
    try:
        while True:
            b = s.recv(4096)
            if not b:
                break
            got += b
    except socket.timeout:
        end = "still open"
    except OSError as e:
        end = f"{type(e).__name__}: {e}"
    emit(read=got.hex(), end=end)
    s.close()


if __name__ == "__main__":
    role = sys.argv[1]
    a = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    {"ranks": ranks, "stranger": stranger}[role](a)
