"""Two hosts with two processes each, as `plait testbed run --nproc-per-node 2` starts them: ranks
are numbered as torchrun numbers them, ranks of one host reach each other over its loopback and
the other host over the cable, and the hierarchical allreduce of examples/schedules sends across
the cable what an allreduce between two hosts must send (its buffer once each way), where the
built-in ring sends half as much again. Bytes are read from the cable's own counters."""

import json
import subprocess
import sys
from pathlib import Path

from plait.tools.testbed import Testbed, cable_iface

ROOT = Path(__file__).resolve().parent.parent.parent
HIER = ROOT / "examples" / "schedules" / "hier_allreduce.json"

MIB = 1 << 20
CALLS = 4
WORKER = f"""
import json, os, numpy as np, plait
from plait.tools.doctor import DoctorStore
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = DoctorStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank == 0, 60)
comm = plait.Communicator(store, rank, n, timeout=60)
x = (np.arange({MIB} // 4) % 97 + rank).astype(np.float32)
want = sum((np.arange({MIB} // 4) % 97 + r).astype(np.float32) for r in range(n))
ok = all(np.array_equal(comm.allreduce(x), want) for _ in range({CALLS}))
routes = {{r["peer"]: r["remote"] for r in comm.routes()}}
print("@@" + json.dumps(dict(rank=rank, local=int(os.environ["LOCAL_RANK"]), host=os.uname().nodename, ok=ok,
                             routes=routes)))
comm.close()
"""


def cable_bytes(tb):
    """Bytes node 0 has sent over its cable to node 1."""
    path = f"/sys/class/net/{cable_iface(0, 1)}/statistics/tx_bytes"
    return int(subprocess.run(["ip", "netns", "exec", tb.ns(0), "cat", path], capture_output=True, text=True,
                              check=True).stdout)


def reports(res):
    out = {}
    for rank, lines in enumerate(res.lines):
        got = [json.loads(line[2:]) for line in lines if line.startswith("@@")]
        assert got, f"rank {rank} printed no report:\n" + "\n".join(lines[-40:])
        out[rank] = got[-1]
    return out


def test_two_hosts_by_two_processes_and_the_hierarchical_allreduce_crossing_the_cable_once(tmp_path):
    with Testbed(2, name="pltest2x2", link_rate=None, lan_rate=None) as tb:
        crossed = {}
        for algo in ("hier_allreduce", "ring"):
            before = cable_bytes(tb)
            res = tb.run([sys.executable, "-c", WORKER], per_node=2, stream=False, timeout=120, grace=10,
                         env={"PLAIT_SCHEDULES": str(HIER), "PLAIT_ALGO": f"allreduce:{algo}"})
            assert res.ok, "\n".join(f"--- rank {r}:\n" + res.output(r)[-2000:] for r in range(len(res.lines)))
            crossed[algo] = (cable_bytes(tb) - before) / (CALLS * MIB)
            got = reports(res)
            assert [got[r]["local"] for r in range(4)] == [0, 1, 0, 1]
            assert got[0]["host"] == got[1]["host"] != got[2]["host"] == got[3]["host"]
            assert all(got[r]["ok"] for r in range(4)), got
            assert got[0]["routes"]["1"].startswith("127.") and got[2]["routes"]["3"].startswith("127.")
            assert not got[0]["routes"]["2"].startswith("127.")
        # What the cable carried per call, in buffers (headers add a few per cent).
        assert 1.0 <= crossed["hier_allreduce"] < 1.1, crossed
        assert 1.5 <= crossed["ring"] < 1.65, crossed

        # plait schedule bench under the testbed runs one rank per process, on the cable.
        before = cable_bytes(tb)
        res = tb.run([sys.executable, "-m", "plait.tools.cli", "schedule", "bench", str(HIER), "-b", "1M", "-e", "1M",
                      "-n", "2", "-w", "0", "--no-gloo", "--json", str(tmp_path / "bench.json")], per_node=2, stream=False,
                     timeout=300)
        assert res.ok, res.output(0)[-3000:]
        assert cable_bytes(tb) - before > 2 * MIB
        rows = json.loads((tmp_path / "bench.json").read_text())["results"]
        assert {row["backend"] for row in rows} >= {"plait:hier_allreduce", "plait:ring"}
        assert all(row["wrong"] == 0 for row in rows)
