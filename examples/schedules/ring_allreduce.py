"""The ring allreduce written in plait's schedule language: it compiles to the same steps as
plait's built-in `ring` (tests/test_schedule.py checks that, and `plait schedule bench` runs both).

    plait schedule check examples/schedules/ring_allreduce.py --nranks 2,3,4,8
"""

from plait.schedule import Program


def build(n):
    p = Program("allreduce", n, name="dsl_ring", description="ring allreduce: reduce-scatter, then allgather, around the ring")
    if n == 1:
        p.input(0, 0).copy(p.output(0, 0))  # one rank: the sum is its own input
        return p
    for b in range(n):
        # Block b starts at rank b and is reduced at each rank it passes ...
        cur = p.input(b, b)
        for hop in range(1, n):
            r = (b + hop) % n
            cur = cur.copy(p.output(r, b), reduce_with=p.input(r, b))
        # ... until rank b-1 holds the sum, which then goes around once more.
        for hop in range(n - 1):
            cur = cur.copy(p.output((b + hop) % n, b))
    return p
