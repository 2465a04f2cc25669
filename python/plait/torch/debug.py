"""Debugging as torch users know it, for plait groups.

- `TORCH_DISTRIBUTED_DEBUG=DETAIL`: torch wraps gloo and NCCL groups in its ProcessGroupWrapper,
  which checks before every collective that all ranks are making the same call; it skips a
  backend whose creator returns a ProcessGroup subclass, as plait's does. `DetailCheck` is that
  check for plait: before each collective, the ranks allgather a fingerprint of the call (the
  c10d call, its sequence number in the group, the shapes, dtypes and devices of the tensors
  gloo's wrapper compares for that call, root and reduce op) over a subgroup on the group's own
  links (no socket is opened). Equal digests: one 16-byte allgather and done. Different digests:
  every rank gathers the whole fingerprints and raises the same MismatchError, naming which ranks
  made which call and what differs; no rank is left waiting. At OFF and INFO nothing is checked
  and nothing is sent.
- The trace (`trace.py`): every group's last N calls, written to a file per rank on a failure.

`attach(g)` is called by every `engine.Group` when it is made, `detach(g)` at its shutdown.
"""

import ctypes
import hashlib
import json
import struct

import torch.distributed as dist

from .. import _core
from . import trace as _trace


def detail_enabled():
    """Whether torch's debug level is DETAIL (TORCH_DISTRIBUTED_DEBUG, or dist.set_debug_level)."""
    try:
        return dist.get_debug_level() == dist.DebugLevel.DETAIL
    except Exception:  # pragma: no cover
        return False


def attach(g):
    """(the group's trace Recorder or None, its DetailCheck or None)."""
    return _trace.recorder_for(g), (DetailCheck(g) if detail_enabled() else None)


def detach(g):
    if getattr(g, "trace", None) is not None:
        _trace.forget(g.trace)
    chk = getattr(g, "check", None)
    if chk is not None:
        chk.close()


# Per call: whose shapes must agree on every rank, and whose dtypes and device types ("in", "out",
# "both" or ""). gloo's wrapper compares the same tensors; where plait accepts what gloo does not,
# shapes that may differ between ranks are left out: an uneven all_gather's inputs (its output
# lists agree), a gather's or scatter's one tensor per rank (the root's list sets the sizes), an
# uneven reduce_scatter's output (its input lists agree), all_to_all's blocks.
_CHECKED = {
    "all_reduce": ("in", "in"), "all_reduce_coalesced": ("in", "in"), "broadcast": ("in", "in"),
    "reduce": ("in", "in"), "gather_into_tensor": ("in", "in"),
    "all_gather": ("out", "both"), "all_gather_coalesced": ("out", "both"),
    "gather": ("", "in"), "scatter": ("", "out"), "reduce_scatter": ("in", "both"),
    "all_gather_into_tensor": ("both", "both"), "all_gather_into_tensor_coalesced": ("both", "both"),
    "reduce_scatter_tensor": ("both", "both"), "reduce_scatter_tensor_coalesced": ("both", "both"),
    "all_to_all_single": ("", "both"), "all_to_all": ("", "both"), "barrier": ("", ""),
}
_ROOTED = ("broadcast", "reduce", "gather", "scatter", "gather_into_tensor")


def _tensors(ts, shapes):
    return [[list(t.shape) if shapes else None, str(t.dtype).replace("torch.", ""), t.device.type]
            for t in ts if hasattr(t, "shape")]


def fingerprint(what, opts, inputs, outputs, seq):
    shapes, kinds = _CHECKED.get(what, ("in", "in"))
    fp = {"op": what, "seq": seq}
    for key, side, ts in (("inputs", "in", inputs), ("outputs", "out", outputs)):
        if kinds in (side, "both"):
            fp[key] = _tensors(ts, shapes in (side, "both"))
    if what in _ROOTED:
        fp["root"] = getattr(opts, "rootRank", None)
    op = getattr(opts, "reduceOp", None)
    if op is not None:
        fp["reduce_op"] = _trace._op_name(op)
    return fp


def _describe(fp):
    parts = []
    for key in ("inputs", "outputs"):
        if key in fp:
            ts = fp[key]
            shapes = f"shapes {[t[0] for t in ts]} " if ts and ts[0][0] is not None else ""
            parts.append(f"{key} {shapes}dtypes {[t[1] for t in ts]} devices {[t[2] for t in ts]}")
    if "root" in fp:
        parts.append(f"root {fp['root']}")
    if "reduce_op" in fp:
        parts.append(f"op {fp['reduce_op']}")
    return f"{fp['op']} #{fp['seq']} ({'; '.join(parts)})" if parts else f"{fp['op']} #{fp['seq']}"


def _differences(fps):
    """What differs between the fingerprints, in words."""
    out = []

    def varies(f):
        return len({json.dumps(f(fp)) for fp in fps}) > 1

    if varies(lambda fp: fp["op"]):
        out.append("the collective")
    if varies(lambda fp: fp["seq"]):
        out.append("the sequence number")
    for key in ("inputs", "outputs"):
        if varies(lambda fp: len(fp.get(key, []))):
            out.append(f"the number of {key[:-1]} tensors")
        else:
            for i, what in ((0, "shapes"), (1, "dtypes"), (2, "device types")):
                if varies(lambda fp: [t[i] for t in fp.get(key, [])]):
                    out.append(f"{key[:-1]} tensor {what}")
    if varies(lambda fp: fp.get("root")):
        out.append("the root")
    if varies(lambda fp: fp.get("reduce_op")):
        out.append("the reduce op")
    return out or ["the call"]


def _address(buf):
    """The address of a bytearray's memory (it must not be resized while the core uses it)."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if len(buf) else 0


def _ranks(rs):
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


class DetailCheck:
    """The collective fingerprint check of one group at TORCH_DISTRIBUTED_DEBUG=DETAIL."""

    def __init__(self, g):
        self.g = g
        self.seq = 0
        self._comm = None
        self._head = bytearray(16)  # this rank's (length, digest) of its fingerprint
        self._heads = bytearray(16 * g.size)  # everyone's

    def comm(self):
        if self._comm is None:
            # Every rank makes the same subgroup, on the group's links, at its first check.
            self._comm = self.g.comm.subgroup("debug-check", list(range(self.g.size)), timeout=self.g.opts.timeout)
        return self._comm

    def close(self):
        c, self._comm = self._comm, None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass

    def run(self, what, opts, inputs, outputs):
        """Raises MismatchError on every rank when the ranks are not making the same call."""
        if what[:4] in ("send", "recv"):
            return
        self.seq += 1
        fp = fingerprint(what, opts, inputs, outputs, self.seq)
        blob = json.dumps(fp, sort_keys=True, separators=(",", ":")).encode()
        g = self.g
        timeout = _trace._seconds(getattr(opts, "timeout", None), g.opts.timeout)
        comm = self.comm()
        digest = hashlib.blake2b(blob, digest_size=8).digest()
        mine, alls = self._head, self._heads
        struct.pack_into("<q8s", mine, 0, len(blob), digest)
        self._allgather(comm, mine, alls, "i64", timeout, what)
        if all(alls[i + 8:i + 16] == digest for i in range(0, len(alls), 16)):
            return
        lens = [struct.unpack_from("<q", alls, i)[0] for i in range(0, len(alls), 16)]
        everyone = bytearray(sum(lens))
        self._allgather(comm, bytearray(blob), everyone, "u8", timeout, what, recv_counts=lens)
        fps, at = [], 0
        for n in lens:
            fps.append(json.loads(bytes(everyone[at:at + n])))
            at += n
        raise _core.MismatchError(self._message(fps))

    def _allgather(self, comm, send, recv, dtype, timeout, what, recv_counts=None):
        """An allgather of bytearrays (no torch call on this path: each costs microseconds)."""
        try:
            # On the caller's thread only when nothing of the group is in flight (engine.runs_inline's rule:
            # the links are shared, and an operation left on a core worker must not go unread).
            comm.collective("allgather", _address(send), len(send), _address(recv), len(recv), dtype, timeout=timeout,
                            inline=self.g.idle(), recv_counts=recv_counts).wait()
        except _core.PlaitError as e:
            raise type(e)(f"plait (TORCH_DISTRIBUTED_DEBUG=DETAIL): the ranks did not all reach {what} "
                          f"#{self.seq} (its fingerprint check): {e}") from None

    def _message(self, fps):
        g = self.g
        groups = {}
        for r, fp in enumerate(fps):
            groups.setdefault(json.dumps(fp, sort_keys=True), []).append(g.global_ranks[r])
        calls = "; ".join(f"{_ranks(rs)} called {_describe(json.loads(k))}" for k, rs in groups.items())
        return (f"plait (TORCH_DISTRIBUTED_DEBUG=DETAIL): ranks called different collectives in process group "
                f"{g.group_id!r}: {calls}. They differ in: {', '.join(_differences(fps))}")


__all__ = ["attach", "detach", "DetailCheck", "detail_enabled", "fingerprint"]
