"""Host memory for the core: CPU tensors in place, everything else through staging buffers.

The core works on raw host addresses. A contiguous CPU tensor is handed over as is (zero copy).
Anything else gets a host copy: a non-contiguous CPU tensor a plain contiguous temporary; a CUDA
or MPS tensor (or any tensor when `force_staging` is on) a buffer from the group's `HostPool`.
Outputs are copied back by `Staged.finish()`, which the Work runs exactly once, before `wait()`
returns or the future completes.

What differs per device type is decided in one place, `strategy(device_type)`: CUDA tensors use
pinned host buffers and copy back on the stream that was current when the op was issued; MPS
tensors (Apple Silicon) use plain host buffers (pinned memory is a CUDA facility) and end with
`torch.mps.synchronize()`; nothing on the CPU or MPS path calls into torch.cuda.
"""

import collections
import threading

import torch

from .. import _core
from .._core import InvalidArgumentError

# torch's type of each core dtype: torch knowledge, keyed by the core's names (checked below).
CORE_DTYPE = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "bool",
}
assert set(CORE_DTYPE.values()) == {d["name"] for d in _core.DTYPES}, "a core dtype has no torch type here"
WIRE_DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16}
_COMPLEX_OK = frozenset({"sum", "avg", "premul_sum"})


def invalid(msg):
    """The error a bad call raises before anything is sent (a ValueError and a RuntimeError)."""
    from .work import torch_error

    return torch_error(InvalidArgumentError(f"plait: {msg}"))


def check_tensor(t, what):
    if not isinstance(t, torch.Tensor):
        raise invalid(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise invalid(f"{what}: {t.layout} tensors are not supported (only dense, strided tensors)")
    if t.device.type == "meta":
        raise invalid(f"{what}: meta tensors have no data to communicate")
    return t


def real_view(t, opname, what):
    """Complex tensors travel as their real and imaginary parts (fine for data movement and for
    sum/avg/premul_sum; refused for the others, whose result would be wrong)."""
    if t.is_complex():
        if opname is not None and opname not in _COMPLEX_OK:
            raise invalid(f"{what}: op {opname} is not defined for complex tensors ({t.dtype})")
        return torch.view_as_real(t)
    return t


def reduce_dtype(t, opname, what):
    dt = CORE_DTYPE.get(t.dtype)
    if dt is None:
        supported = ", ".join(str(d).replace("torch.", "") for d in CORE_DTYPE)
        raise invalid(f"{what}: dtype {t.dtype} cannot be reduced (plait reduces {supported} and complex)")
    if opname is not None:
        try:  # the core's rule, asked rather than copied
            _core.check_op(opname, dt, 1.0 if opname == "premul_sum" else None)
        except InvalidArgumentError as e:
            raise invalid(f"{what}: {e} (a {t.dtype} tensor)") from None
    return dt


def move_dtype(dtype):
    """(core dtype, bytes per element of that core dtype) for a pure data movement: any dtype
    travels, as bytes when the core has no name for it."""
    dt = CORE_DTYPE.get(dtype)
    if dt is not None:
        return dt
    return "u8"


def nbytes(t):
    return t.numel() * t.element_size()


def overlaps(a, b):
    """Whether host tensors `a` and `b` share any byte of memory."""
    na, nb = nbytes(a), nbytes(b)
    return bool(na and nb and a.data_ptr() < b.data_ptr() + nb and b.data_ptr() < a.data_ptr() + na)


def elems(t, core_dt):
    """Element count of `t` in units of `core_dt`."""
    if core_dt == "u8" and t.dtype != torch.uint8:
        return nbytes(t)
    return t.numel()


def _next_pow2(n):
    return 1 << max(12, (n - 1).bit_length())


Strategy = collections.namedtuple("Strategy", "direct pinned cuda_stream mps_sync")
Strategy.__doc__ = """How a tensor on one device type meets the core's host memory:
direct       a contiguous tensor is handed over in place (CPU only)
pinned       staging buffers are page-locked (CUDA only: faster, truly async H2D/D2H copies)
cuda_stream  copies back run on the CUDA stream current when the op was issued
mps_sync     copies back are followed by torch.mps.synchronize() (the buffer is reused after)"""

_STRATEGIES = {
    "cpu": Strategy(direct=True, pinned=False, cuda_stream=False, mps_sync=False),
    "cuda": Strategy(direct=False, pinned=True, cuda_stream=True, mps_sync=False),
    "mps": Strategy(direct=False, pinned=False, cuda_stream=False, mps_sync=True),
}
_OTHER = Strategy(direct=False, pinned=False, cuda_stream=False, mps_sync=False)  # plain host copies


def strategy(device_type):
    """The staging strategy for tensors of `device_type` ("cpu", "cuda", "mps", ...): see
    `Strategy`. Any other device is staged through plain host buffers with blocking copies."""
    return _STRATEGIES.get(device_type, _OTHER)


class HostPool:
    """Reusable host buffers, in power-of-two sizes, at most `cap` bytes kept when idle; pinned
    ones (for CUDA tensors, when CUDA is available) are kept apart from plain ones."""

    def __init__(self, cap):
        self._cap = cap
        self._free = {}
        self._kept = 0
        self._lock = threading.Lock()
        self._pin = None

    def _can_pin(self):
        if self._pin is None:
            try:
                self._pin = bool(torch.cuda.is_available())
            except Exception:  # pragma: no cover
                self._pin = False
        return self._pin

    def acquire(self, n, pinned=False):
        """(buffer, pinned): a uint8 host tensor of at least n bytes, page-locked when `pinned`
        was asked for and CUDA is there. Give both back to `release`."""
        pinned = bool(pinned) and self._can_pin()
        size = _next_pow2(n)
        with self._lock:
            lst = self._free.get((size, pinned))
            if lst:
                self._kept -= size
                return lst.pop(), pinned
        if pinned:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True), True
        return torch.empty(size, dtype=torch.uint8), False

    def release(self, buf, pinned=False):
        size = buf.numel()
        with self._lock:
            if self._kept + size <= self._cap:
                self._free.setdefault((size, pinned), []).append(buf)
                self._kept += size

    def clear(self):
        with self._lock:
            self._free.clear()
            self._kept = 0


def _stream_ctx(t):
    """Runs copies for device tensor `t` on the stream current when the op was issued."""
    if strategy(t.device.type).cuda_stream:
        stream = torch.cuda.current_stream(t.device)

        def ctx():
            return torch.cuda.stream(stream)

        return ctx
    return None


class _Nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


_NULL = _Nullctx()


class Staged:
    """The host memory of one operation and what to do when it ends."""

    __slots__ = ("_pool", "_force", "keep", "_after", "_pooled", "_sync_mps", "_done")

    def __init__(self, pool, force):
        self._pool = pool
        self._force = force
        self.keep = []  # tensors the core reads or writes: alive until the op ends
        self._after = []  # copy-backs, in order
        self._pooled = []
        self._sync_mps = False
        self._done = False

    def direct(self, t):
        return strategy(t.device.type).direct and t.is_contiguous() and not self._force

    def _tmp(self, t, shape, dtype):
        n = 1
        for s in shape:
            n *= s
        esize = torch.empty((), dtype=dtype).element_size()
        how = strategy(t.device.type)
        if how.direct and not self._force:
            return torch.empty(shape, dtype=dtype)
        buf, pinned = self._pool.acquire(max(1, n * esize), pinned=how.pinned)
        self._pooled.append((buf, pinned))
        return buf[: n * esize].view(dtype).view(shape)

    def host(self, t, *, read, write):
        """A contiguous CPU tensor with `t`'s shape and dtype that the core may use: `t` itself
        when possible, else a staged copy (filled when `read`, copied back when `write`)."""
        if self.direct(t):
            self.keep.append(t)
            return t
        h = self._tmp(t, tuple(t.shape), t.dtype)
        self.keep.append(h)
        if read:
            with torch.no_grad():
                h.copy_(t)  # blocking: waits for the kernels that produce `t` on its stream
        if write:
            self.copy_back(t, h)
        return h

    def flat(self, ts, *, read, write, dtype=None):
        """One contiguous 1-D host tensor holding `ts` one after the other: a view over their
        storage when they already lie that way on the CPU (zero copy), else a staged copy."""
        dtype = dtype if dtype is not None else ts[0].dtype
        total = sum(t.numel() for t in ts)
        if not self._force:
            v = adjacent_view(ts, dtype, total)
            if v is not None:
                self.keep.append(v)
                self.keep.extend(ts)
                return v
        h = self._tmp(ts[0] if ts else torch.empty(0), (total,), dtype)
        self.keep.append(h)
        off = 0
        for t in ts:
            n = t.numel()
            part = h[off : off + n].view(t.shape)
            if read and n:
                with torch.no_grad():
                    part.copy_(t)
            if write and n:
                self.copy_back(t, part)
            off += n
        return h

    def separate(self, t):
        """A host buffer of `t`'s shape and dtype, apart from `t`, that the core writes; copied into
        `t` when the op ends (for a result built while `t` is still being read)."""
        h = self._tmp(t, tuple(t.shape), t.dtype)
        self.keep.append(h)
        self.copy_back(t, h)
        return h

    def converted(self, ts, dtype, *, read, write):
        """One flat CPU buffer of `dtype` holding `ts` converted to it (when `read`), converted back
        into `ts` when the op ends (when `write`)."""
        h = torch.empty(sum(t.numel() for t in ts), dtype=dtype)
        off = 0
        for t in ts:
            part = h[off : off + t.numel()].view(t.shape)
            if read:
                with torch.no_grad():
                    part.copy_(t)
            if write:
                self.copy_back(t, part)
            off += t.numel()
        self.keep.append(h)
        return h

    def in_place_or_host(self, block, whole, index):
        """`block` itself when it already is block `index` of the host buffer `whole` (an in-place
        call), else its host form (read)."""
        n = nbytes(block)
        if n and self.direct(block) and block.data_ptr() == whole.data_ptr() + index * n:
            return block
        return self.host(block, read=True, write=False)

    def apart_from(self, src, dst):
        """`src`, or a copy of it when its memory overlaps `dst`'s: the core reads one while it
        writes the other."""
        if not overlaps(src, dst):
            return src
        c = src.clone()
        self.keep.append(c)
        return c

    def copy_back(self, dst, src):
        """Copies `src` into `dst` when the op ends well, after the copy-backs added before."""
        ctx = _stream_ctx(dst)
        if strategy(dst.device.type).mps_sync:
            self._sync_mps = True
        self._after.append((dst, src, ctx))

    def finish(self, ok=True):
        """Copies outputs back (when `ok`) and returns the staging memory. Idempotent."""
        if self._done:
            return
        self._done = True
        try:
            if ok:
                with torch.no_grad():
                    for dst, src, ctx in self._after:
                        # A tensor made under torch.inference_mode() may only be written in it;
                        # this runs on whichever thread ends the op, outside the caller's mode.
                        with ctx() if ctx else _NULL, torch.inference_mode() if dst.is_inference() else _NULL:
                            dst.copy_(src)
                if self._sync_mps:
                    torch.mps.synchronize()  # the staging buffer is reused after this
        finally:
            self._after = []
            self.keep = []
            for b, pinned in self._pooled:
                self._pool.release(b, pinned)
            self._pooled = []


def adjacent_view(ts, dtype, total):
    """A 1-D tensor over `ts` if they are contiguous CPU tensors of `dtype` lying back to back in
    one storage, in order; else None."""
    first = None
    ptr = None
    for t in ts:
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            return None
        if t.numel() == 0:
            continue
        if first is None:
            first = t
            ptr = t.data_ptr()
            sptr = t.untyped_storage().data_ptr()
        elif t.data_ptr() != ptr or t.untyped_storage().data_ptr() != sptr:
            return None
        ptr += t.numel() * t.element_size()
    if first is None:
        return torch.empty(0, dtype=dtype)
    v = torch.empty(0, dtype=dtype)
    v.set_(first.untyped_storage(), first.storage_offset(), (total,), (1,))
    return v
