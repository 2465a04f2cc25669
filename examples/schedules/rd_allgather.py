"""Recursive-doubling allgather for a power-of-two number of ranks: in step j every rank swaps
everything it has gathered so far with the rank 2**j away, so n ranks finish in log2(n) steps
(plait's built-ins take n - 1 steps, `ring`, or send n - 1 messages from every rank at once,
`direct`). Each step's blocks to one peer travel as one frame when they are small.

    plait schedule check examples/schedules/rd_allgather.py --nranks 2,4,8
    plait schedule bench examples/schedules/rd_allgather.py --nranks 4 -b 1K -e 1M
"""

from plait.schedule import Program


def build(n):
    if n & (n - 1):
        raise ValueError(f"recursive doubling needs a power-of-two number of ranks, not {n}")
    p = Program("allgather", n, name="rd_allgather",
                description="recursive doubling: log2(n) steps, each swapping every block gathered so far")
    for r in range(n):
        p.input(r, 0).copy(p.output(r, r))
    d = 1
    while d < n:
        for r in range(n):
            peer = r ^ d
            first = (r // d) * d  # the d blocks rank r holds after the steps so far
            for b in range(first, first + d):
                (p.input(r, 0) if b == r else p.output(r, b)).copy(p.output(peer, b))
        d *= 2
    return p
