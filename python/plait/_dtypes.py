"""numpy dtype <-> core dtype names, and which reduction ops each dtype supports."""

import numpy as np

from ._core import InvalidArgumentError

try:  # bfloat16 has no numpy builtin; ml_dtypes provides the standard one.
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is optional
    BFLOAT16 = None

_BY_NUMPY = {
    np.dtype(np.float16): "f16",
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.int8): "i8",
    np.dtype(np.uint8): "u8",
    np.dtype(np.int16): "i16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
    np.dtype(np.bool_): "bool",
}
if BFLOAT16 is not None:
    _BY_NUMPY[BFLOAT16] = "bf16"

FLOATS = frozenset({"f16", "bf16", "f32", "f64"})
OPS = ("sum", "avg", "prod", "min", "max", "band", "bor", "bxor", "premul_sum")
_BITWISE = frozenset({"band", "bor", "bxor"})
_FLOAT_ONLY = frozenset({"avg", "premul_sum"})


def supported_dtypes():
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
    """Validates op for a core dtype; returns (op, factor) normalised. Raises InvalidArgumentError."""
    if not isinstance(op, str):
        raise InvalidArgumentError(f"op must be a string such as 'sum', got {op!r}")
    op = op.lower()
    if op not in OPS:
        raise InvalidArgumentError(f"unknown op {op!r} (expected one of {', '.join(OPS)})")
    if op in _BITWISE and dtype_name in FLOATS:
        raise InvalidArgumentError(f"op {op!r} is bitwise and not defined for floating dtype {dtype_name}")
    if op in _FLOAT_ONLY and dtype_name not in FLOATS:
        raise InvalidArgumentError(f"op {op!r} is only defined for floating dtypes, not {dtype_name}")
    if op == "premul_sum":
        if factor is None:
            raise InvalidArgumentError("op 'premul_sum' needs factor=<number>")
        factor = float(factor)
    elif factor is not None:
        raise InvalidArgumentError(f"factor is only used with op 'premul_sum', not {op!r}")
    return op, factor

