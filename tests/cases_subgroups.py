"""Subgroups of the direct API on their owner's connections (run by test_subgroups.py)."""

import threading

import numpy as np

import plait


def run(ctx):
    n, me = ctx.n, ctx.rank
    # The world and its subgroups are created here and each driven from a thread of its own below,
    # one thread per communicator: "sequential" (the default lets only the creating thread call).
    comm = ctx.new_comm(timeout=20, threads="sequential")
    evens = list(range(0, n, 2))
    odds = list(range(1, n, 2))
    mine = comm.subgroup(evens if me % 2 == 0 else odds, "parity")
    backwards = comm.subgroup(list(reversed(range(n))), "backwards")
    ctx.check("subgroup ranks", None if (mine.rank, backwards.rank) == ((evens if me % 2 == 0 else odds).index(me), n - 1 - me)
              else f"got {(mine.rank, backwards.rank)}")

    # The three groups at once: each call's frames interleave with the others' on the same links.
    results = {}

    def on(name, c, x):
        results[name] = c.allreduce(x)

    x = np.arange(100_003, dtype=np.float64) + me
    threads = [threading.Thread(target=on, args=(name, c, x)) for name, c in
               (("world", comm), ("parity", mine), ("backwards", backwards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    base = np.arange(100_003, dtype=np.float64)
    for name, members in (("world", range(n)), ("parity", evens if me % 2 == 0 else odds), ("backwards", range(n))):
        want = base * len(members) + sum(members)
        got = results.get(name)
        ctx.check(f"concurrent allreduce on {name}", None if got is not None and np.array_equal(got, want) else f"got {got}")

    # Point-to-point in a subgroup names its own ranks: world rank `peer` is n-1-peer there.
    peer = n - 1 - me
    if peer != me:
        msg, got = np.full(7, float(me)), np.empty(7)
        if me < peer:
            backwards.send(msg, n - 1 - peer, tag=5)
            source = backwards.recv(got, n - 1 - peer, tag=5)
        else:
            source = backwards.recv(got, n - 1 - peer, tag=5)
            backwards.send(msg, n - 1 - peer, tag=5)
        ctx.check("subgroup send/recv", None if np.all(got == peer) and source == n - 1 - peer else f"got {got} from {source}")

    # Wrong arguments are refused before anything is sent.
    for ranks, want in (([(me + 1) % n] if n > 1 else [], "not in"), ([me, me], "twice")):
        try:
            comm.subgroup(ranks, "bad")
        except plait.PlaitError as e:
            ctx.check(f"subgroup {ranks} refused", None if want in str(e) else str(e))
        else:
            ctx.check(f"subgroup {ranks} refused", "no error")
    mine.close()
    backwards.close()
    y = comm.allreduce(np.ones(3))
    ctx.check("owner works after its subgroups closed", None if np.all(y == n) else f"got {y}")
