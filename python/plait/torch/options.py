"""Options of a plait process group: `init_process_group(backend="plait", pg_options=PlaitOptions(...))`.

Every field may also come from the environment (read when the group is created); an explicit
option wins over the environment, which wins over torch's group timeout only for `timeout`.
"""

import dataclasses
import datetime
import os

from .._core import ConfigError

_WIRE = {None: None, "": None, "none": None, "native": None, "bf16": "bf16", "bfloat16": "bf16", "f16": "f16",
         "fp16": "f16", "float16": "f16", "int8": "int8", "i8": "int8"}
_INLINE = ("auto", "always", "never")


@dataclasses.dataclass
class PlaitOptions:
    """Per-group settings. Pass as `pg_options=` to `init_process_group` or `new_group`, or a dict
    with the same keys.

    timeout        seconds (or a timedelta) for set-up and every operation of the group; default:
                   the group's torch timeout, or PLAIT_TIMEOUT when torch's is its default.
    algo           PLAIT_ALGO syntax, e.g. "allreduce:ring,allgather:direct".
    wire_dtype     "bf16" or "f16": float32/float64 reductions (allreduce, reduce_scatter, reduce)
                   travel and are summed in that type and are converted back (halves the bytes;
                   costs precision, like mccl's bf16 wire). Env PLAIT_WIRE_DTYPE.
    inline         "auto": a blocking call (async_op=False) of at most `inline_bytes` runs on the
                   caller's thread when no other operation of the group is in flight; "always":
                   every blocking call does; "never". Env PLAIT_TORCH_INLINE.
    inline_bytes   see `inline`. Env PLAIT_TORCH_INLINE_BYTES.
    force_staging  copy CPU tensors through the host staging buffers as CUDA/MPS tensors are (so
                   CI exercises that path). Env PLAIT_TORCH_STAGING=1.
    staging_cache_bytes  host staging memory kept for reuse per group.
    """

    timeout: object = None
    algo: object = None
    wire_dtype: object = None
    inline: str = None
    inline_bytes: int = None
    force_staging: bool = None
    staging_cache_bytes: int = None

    def resolved(self, torch_timeout):
        """A copy with every field filled from the environment and defaults; validates."""
        o = dataclasses.replace(self)
        env = os.environ
        if isinstance(o.timeout, datetime.timedelta):
            o.timeout = o.timeout.total_seconds()
        if o.timeout is None:
            t = torch_timeout.total_seconds() if isinstance(torch_timeout, datetime.timedelta) else torch_timeout
            try:
                from torch.distributed.constants import default_pg_timeout
                is_default = torch_timeout == default_pg_timeout
            except Exception:  # pragma: no cover
                is_default = False
            if (is_default or t is None or t <= 0) and env.get("PLAIT_TIMEOUT", "").strip():
                t = _float_env("PLAIT_TIMEOUT")
            o.timeout = t
        if o.timeout is not None:
            o.timeout = float(o.timeout)
            if not o.timeout > 0:
                raise ConfigError(f"plait: timeout must be a positive number of seconds, got {o.timeout}")
        if o.algo is None:
            o.algo = env.get("PLAIT_ALGO") or None
        if o.wire_dtype is None:
            o.wire_dtype = env.get("PLAIT_WIRE_DTYPE") or None
        key = o.wire_dtype.lower() if isinstance(o.wire_dtype, str) else o.wire_dtype
        if key not in _WIRE:
            raise ConfigError(f"plait: wire_dtype must be 'bf16', 'f16', 'int8', 'native' or None, got {o.wire_dtype!r}")
        o.wire_dtype = _WIRE[key]
        if o.inline is None:
            o.inline = env.get("PLAIT_TORCH_INLINE") or "auto"
        if o.inline not in _INLINE:
            raise ConfigError(f"plait: inline must be one of {', '.join(_INLINE)}, got {o.inline!r}")
        if o.inline_bytes is None:
            o.inline_bytes = int(_float_env("PLAIT_TORCH_INLINE_BYTES", 1 << 20))
        if o.force_staging is None:
            o.force_staging = env.get("PLAIT_TORCH_STAGING", "").strip().lower() in ("1", "true", "yes", "on")
        if o.staging_cache_bytes is None:
            o.staging_cache_bytes = int(_float_env("PLAIT_TORCH_STAGING_CACHE", 256 << 20))
        return o


def _float_env(name, default=None):
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        return float(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r} is not a number") from None


def from_pg_options(obj):
    """PlaitOptions from what the user passed as pg_options (None, PlaitOptions, or a dict)."""
    if obj is None:
        return PlaitOptions()
    if isinstance(obj, PlaitOptions):
        return obj
    if isinstance(obj, dict):
        names = {f.name for f in dataclasses.fields(PlaitOptions)}
        bad = sorted(set(obj) - names)
        if bad:
            raise ConfigError(f"plait: unknown pg_options key(s) {bad}; valid: {sorted(names)}")
        return PlaitOptions(**obj)
    # torch's own Options objects (e.g. from new_group defaults): take the timeout if any.
    t = getattr(obj, "_timeout", None)
    return PlaitOptions(timeout=t if isinstance(t, datetime.timedelta) and t.total_seconds() > 0 else None)
