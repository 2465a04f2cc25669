# A scenario from the review of elastic mode (tests/test_elastic.py runs it): one process per role.
# A, B, C form a group; C starts the epoch's first allreduce at once (publishes its bootstrap
# record, waits for the others'), then stops itself (SIGSTOP). A and B start 0.6 s later: they
# read C's record and wait in the connect phase. How long until A and B's allreduce returns?
import os, sys, time, signal, threading, json

import numpy as np
import plait, plait.elastic
role, d = sys.argv[1], sys.argv[2]
HB, TO = 1.0, 20.0
def log(**k):
    k["role"] = role; k["t"] = round(time.time() % 1000, 3); print(json.dumps(k), flush=True)
def contact(r):
    p = f"{d}/{r}"
    while not os.path.exists(p): time.sleep(0.05)
    return open(p).read()
peers = [] if role == "A" else [contact("A")]
if role == "C":
    while not os.path.exists(f"{d}/B.in"): time.sleep(0.05)
c = plait.elastic.join(peers, listen="127.0.0.1:0", heartbeat_timeout=HB, timeout=TO)
open(f"{d}/{role}.tmp", "w").write(c.contact); os.rename(f"{d}/{role}.tmp", f"{d}/{role}")
if role == "B": open(f"{d}/B.in", "w").write("1")
log(ev="joined", epoch=c.epoch)
c.update()
while c.world_size < 3:
    c.update()
log(ev="three", epoch=c.epoch, rank=c.rank)
x = np.ones(4)
if role == "C":
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGSTOP)).start()
else:
    time.sleep(0.6)
t = time.time()
try:
    c.allreduce(x, out=x); log(ev="ok", took=round(time.time()-t, 2), x=x.tolist(), epoch=c.epoch)
except plait.PlaitError as e:
    log(ev="err", took=round(time.time()-t, 2), kind=type(e).__name__, msg=str(e)[:200], epoch=c.epoch, members=len(c.members))
os._exit(0)
