"""gloo's monitored barrier for a plait group, through the group's store (a rank that is late must
not break the communicator): rank 0 waits for every rank and names the ones that did not arrive
within the timeout; the others wait for rank 0's verdict."""

import datetime
import time

from .. import _core
from .staging import invalid
from .work import torch_error


def monitored_barrier(g, timeout=None, wait_all_ranks=False):
    if hasattr(timeout, "timeout") and not isinstance(timeout, datetime.timedelta):
        timeout = timeout.timeout  # BarrierOptions
    if isinstance(timeout, datetime.timedelta):
        t = max(0.0, timeout.total_seconds())
    elif timeout is None:
        t = g.timeout
    else:
        t = max(0.0, float(timeout))
    store = g.store
    if store is None:
        raise invalid("monitored_barrier: this group has no store")
    g.mb_seq += 1
    base = f"plait/monitored_barrier/{g.mb_seq}"
    start = time.monotonic()
    if g.rank != 0:
        store.set(f"{base}/arrived/{g.rank}", b"1")
        verdict = None
        try:
            store.wait([f"{base}/verdict"], datetime.timedelta(seconds=max(t, 0.001)))
            verdict = bytes(store.get(f"{base}/verdict")).decode()
        except Exception:
            pass
        if verdict != "ok":
            why = f"rank 0 reported: {verdict}" if verdict else f"no word from rank 0 within {t:g} s"
            raise torch_error(_core.PlaitTimeoutError(
                f"Rank {g.rank} successfully reached monitoredBarrier, but received errors while waiting "
                f"for send/recv from rank 0 ({why})"))
        return
    failed = []
    if t <= 0 and g.size > 1:
        msg = "Rank 0 timed out in monitoredBarrier after 0 ms"
        store.set(f"{base}/verdict", msg.encode())
        raise torch_error(_core.PlaitTimeoutError(msg))
    for r in range(1, g.size):
        left = t - (time.monotonic() - start)
        key = f"{base}/arrived/{r}"
        try:
            if left > 0:
                store.wait([key], datetime.timedelta(seconds=left))
            elif not store.check([key]):
                raise TimeoutError
        except Exception:
            failed.append(r)
            if not wait_all_ranks:
                break
    ms = int(t * 1000)
    if failed:
        msg = (f"Rank {failed[0]} failed to pass monitoredBarrier in {ms} ms" if len(failed) == 1 and not wait_all_ranks
               else f"Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier in {ms} ms")
        try:
            store.set(f"{base}/verdict", msg.encode())
        except Exception:
            pass
        raise torch_error(_core.PlaitTimeoutError(msg))
    store.set(f"{base}/verdict", b"ok")
