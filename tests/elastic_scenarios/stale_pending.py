# A scenario from the review of elastic mode (tests/test_elastic.py runs it): one process per role.
# A and B form a group. J asks A to join (A tells B: Pending) but gives up (its join times out:
# the members were not at an update point). Then A and B call update() 6 times.
import os, sys, time, json

import plait, plait.elastic
role, d = sys.argv[1], sys.argv[2]
def log(**k):
    k["role"] = role; print(json.dumps(k), flush=True)
def contact(r):
    p = f"{d}/{r}"
    while not os.path.exists(p): time.sleep(0.05)
    return open(p).read()
if role == "J":
    while not os.path.exists(f"{d}/B.in"): time.sleep(0.05)
    try:
        plait.elastic.join([contact("A")], listen="127.0.0.1:0", heartbeat_timeout=1.0, timeout=1.5)
    except plait.PlaitError as e:
        log(ev="join_failed", kind=type(e).__name__)
    os._exit(0)
peers = [] if role == "A" else [contact("A")]
c = plait.elastic.join(peers, listen="127.0.0.1:0", heartbeat_timeout=1.0, timeout=20)
open(f"{d}/{role}.tmp", "w").write(c.contact); os.rename(f"{d}/{role}.tmp", f"{d}/{role}")
c.update()
while c.world_size < 2:
    c.update()
if role == "B": open(f"{d}/B.in", "w").write("1")
time.sleep(4)   # J asks and gives up meanwhile
for i in range(6):
    t = time.time()
    changed = c.update()
    log(i=i, changed=changed, epoch=c.epoch, members=len(c.members), pending=c.pending(), took=round(time.time()-t, 3))
c.close()
os._exit(0)
