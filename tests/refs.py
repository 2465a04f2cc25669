"""Deterministic per-rank inputs and numpy references. Every rank can regenerate every rank's input
from (seed, rank), so each checks its own output without extra communication.

Inputs are small integers stored in any dtype, so sums, products, min and max are exact in every
format (f16 and bf16 included) and any reordering of the reduction gives the same bits; only avg and
premul_sum with an inexact factor round, and they are compared within a few ulps."""

import numpy as np

import ml_dtypes

DTYPES = {
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "i8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
    "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
FLOATS = ("f16", "bf16", "f32", "f64")
INTS = ("i8", "u8", "i16", "i32", "i64")
EPS = {"f16": 2.0**-10, "bf16": 2.0**-7, "f32": 2.0**-23, "f64": 2.0**-52}


def ops_for(dt):
    if dt in FLOATS:
        return ["sum", "avg", "prod", "min", "max", "premul_sum"]
    return ["sum", "prod", "min", "max", "band", "bor", "bxor"]


def gen(seed, rank, count, dt, op="sum"):
    """Rank `rank`'s input for a case: `count` elements of dtype `dt` suited to `op`."""
    rng = np.random.default_rng([seed, rank])
    dtype = DTYPES[dt]
    if dt == "bool":
        return rng.random(count) < (0.8 if op in ("prod", "min", "band") else 0.3)
    if op in ("band", "bor", "bxor"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
    signed = dt != "u8"
    if op == "prod":  # |product| <= 9 for any world size: only ranks 0 and 1 contribute magnitude
        mag = rng.integers(1, 4, count) if rank < 2 else np.ones(count, dtype=np.int64)
        sign = rng.choice([-1, 1], count) if signed else 1
        return (mag * sign).astype(dtype)
    lo, hi = (-8, 8) if signed else (0, 15)  # sums stay within i8 for 8 ranks
    return rng.integers(lo, hi, count, endpoint=True).astype(dtype)


def gen_normal(seed, rank, count, dt):
    """Non-integer floats (for rounding-sensitive checks such as bit-identical results)."""
    rng = np.random.default_rng([seed, rank, 7])
    return rng.standard_normal(count).astype(DTYPES[dt])


def reduce(arrs, dt, op, factor=None):
    """The exact reduction, rounded once to dt (what an exact implementation returns)."""
    dtype = DTYPES[dt]
    n = len(arrs)
    if dt == "bool":
        s = np.stack(arrs)
        if op in ("sum", "max", "bor"):
            return s.any(axis=0)
        if op in ("prod", "min", "band"):
            return s.all(axis=0)
        return (s.sum(axis=0) % 2).astype(bool)  # bxor
    if dt in FLOATS:
        s = np.stack([a.astype(np.float64) for a in arrs])
    else:
        s = np.stack(arrs)
    if op in ("sum", "avg", "premul_sum"):
        r = s.sum(axis=0, dtype=s.dtype)
        if op == "avg":
            r = r / n
        elif op == "premul_sum":
            r = r * factor
    elif op == "prod":
        r = s.prod(axis=0, dtype=s.dtype)
    elif op == "min":
        r = s.min(axis=0)
    elif op == "max":
        r = s.max(axis=0)
    elif op == "band":
        r = np.bitwise_and.reduce(s, axis=0)
    elif op == "bor":
        r = np.bitwise_or.reduce(s, axis=0)
    elif op == "bxor":
        r = np.bitwise_xor.reduce(s, axis=0)
    else:
        raise ValueError(op)
    return np.asarray(r).astype(dtype)


def compare(got, want, dt, ulps=0):
    """None if got matches want (exactly, or within `ulps` units of the last place for floats);
    otherwise a short description of the first differences."""
    got = np.asarray(got).reshape(-1)
    want = np.asarray(want).reshape(-1)
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if got.size != want.size:
        return f"{got.size} elements, expected {want.size}"
    if got.size == 0:
        return None
    if dt == "bool":
        raw = got.view(np.uint8)
        if raw.max(initial=0) > 1:
            return f"invalid bool bytes (values {sorted(set(raw[raw > 1].tolist()))[:5]})"
    if ulps and dt in FLOATS:
        g, w = got.astype(np.float64), want.astype(np.float64)
        tol = ulps * EPS[dt] * np.maximum(np.abs(w), np.finfo(DTYPES[dt] if dt != "bf16" else np.float32).tiny)
        bad = np.flatnonzero(~(np.abs(g - w) <= tol))
    else:
        bad = np.flatnonzero(got.view(_uint(got.dtype)) != want.view(_uint(want.dtype)))  # bitwise
    if bad.size == 0:
        return None
    i = bad[:4]
    return (f"{bad.size}/{got.size} elements differ; first at {i.tolist()}: "
            f"got {got[i].tolist()}, expected {want[i].tolist()}")


def _uint(dtype):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]


def split(a, counts):
    offs = np.cumsum([0] + list(counts))
    return [a[offs[i]:offs[i + 1]] for i in range(len(counts))]


def uneven_counts(seed, n, base):
    """n counts around `base` (some zero when base is small), the same on every rank."""
    rng = np.random.default_rng([seed, 99])
    if base == 0:
        return [0] * n
    return [int(c) for c in rng.integers(0, 2 * base + 1, n)]
