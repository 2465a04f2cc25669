"""Turning user buffers into contiguous numpy views, and the checks done before the core sees them."""

import operator

import numpy as np

from ._core import InvalidArgumentError
from ._dtypes import core_dtype


def as_input(x, what, name="x"):
    """A C-contiguous ndarray over x's memory (no copy). Anything numpy can view is accepted."""
    if x is None:
        raise InvalidArgumentError(f"{what}: {name} is required")
    a = _view(x)
    core_dtype(a.dtype)  # TypeError for unsupported dtypes
    if not a.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{what}: {name} is not C-contiguous (shape {a.shape}, strides {a.strides}); "
            "pass np.ascontiguousarray(...)"
        )
    return a


def as_output(x, what, name="out"):
    """Like as_input, but x must be a real buffer (ndarray or buffer protocol) and writable."""
    if not isinstance(x, np.ndarray):
        try:
            memoryview(x)
        except TypeError:
            raise InvalidArgumentError(
                f"{what}: {name} must be a numpy array or a writable buffer, got {type(x).__name__}"
            ) from None
    a = as_input(x, what, name)
    if not a.flags.writeable:
        raise InvalidArgumentError(f"{what}: {name} is read-only")
    return a


def _view(x):
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(memoryview(x))
    except (TypeError, ValueError):
        return np.asarray(x)


def check_out(out, like, count, what, name="out"):
    """out must hold exactly `count` elements of like's dtype."""
    if out.dtype != like.dtype:
        raise InvalidArgumentError(f"{what}: {name} has dtype {out.dtype}, expected {like.dtype}")
    if out.size != count:
        raise InvalidArgumentError(
            f"{what}: {name} has {out.size} elements, expected {count}"
            + (" (too small)" if out.size < count else " (too large)")
        )


def check_rank(r, size, what, name):
    try:
        r = operator.index(r)
    except TypeError:
        raise InvalidArgumentError(f"{what}: {name} must be an int, got {r!r}") from None
    if not 0 <= r < size:
        raise InvalidArgumentError(f"{what}: {name}={r} is out of range for world size {size}")
    return r


def check_counts(counts, size, what, name="counts", total=None):
    """A list of `size` non-negative ints, summing to `total` when given."""
    try:
        counts = [operator.index(c) for c in counts]
    except TypeError:
        raise InvalidArgumentError(f"{what}: {name} must be a sequence of ints, got {counts!r}") from None
    if len(counts) != size:
        raise InvalidArgumentError(f"{what}: {name} has {len(counts)} entries, expected world size {size}")
    if any(c < 0 for c in counts):
        raise InvalidArgumentError(f"{what}: {name} has a negative entry: {counts}")
    if total is not None and sum(counts) != total:
        raise InvalidArgumentError(f"{what}: {name} sum to {sum(counts)}, but the buffer has {total} elements")
    return counts


def addr(a):
    return a.ctypes.data if a.nbytes else 0


def overlaps(a, b):
    return a.nbytes > 0 and b.nbytes > 0 and np.may_share_memory(a, b)


def separate(send, recv, in_place_ok=False):
    """The send buffer to use: itself, or a copy when it overlaps recv in a way the core does not
    define as in place."""
    if in_place_ok or not overlaps(send, recv):
        return send
    return send.copy()
