"""numpy dtype <-> core dtype names; which reduction ops each dtype supports is the core's rule
(`_core.check_op`), read here, not copied."""

import numpy as np

from . import _core
from ._core import InvalidArgumentError

try:  # bfloat16 has no numpy builtin; ml_dtypes provides the standard one.
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is optional
    BFLOAT16 = None

# The numpy type of each core dtype: numpy knowledge, keyed by the core's names (checked below).
_NUMPY_OF = {
    "f16": np.float16,
    "bf16": BFLOAT16,
    "f32": np.float32,
    "f64": np.float64,
    "i8": np.int8,
    "u8": np.uint8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "bool": np.bool_,
}
assert set(_NUMPY_OF) == {d["name"] for d in _core.DTYPES}, "a core dtype has no numpy type here"
_BY_NUMPY = {np.dtype(t): d["name"] for d in _core.DTYPES if (t := _NUMPY_OF[d["name"]]) is not None}

FLOATS = frozenset(d["name"] for d in _core.DTYPES if d["float"])
OPS = tuple(o["name"] for o in _core.OPS)


def supported_dtypes() -> "list[np.dtype]":
    """The numpy dtypes plait can move, in core order."""
    return list(_BY_NUMPY)


def core_dtype(dtype):
    """The core's name for a numpy dtype; TypeError if plait cannot move it."""
    dt = np.dtype(dtype)
    name = _BY_NUMPY.get(dt)
    if name is None:
        if dt.byteorder not in "=|" and dt.newbyteorder("=") in _BY_NUMPY:
            raise TypeError(f"plait: dtype {dt.str} is not in native byte order")
        known = ", ".join(str(d) for d in _BY_NUMPY)
        raise TypeError(f"plait: unsupported dtype {dt} (supported: {known})")
    return name


def check_op(op, dtype_name, factor):
    """Validates op for a core dtype by the core's rules; returns (op, factor) normalised. Raises
    InvalidArgumentError."""
    if not isinstance(op, str):
        raise InvalidArgumentError(f"op must be a string such as 'sum', got {op!r}")
    return _core.check_op(op.lower(), dtype_name, factor)
