"""Options of a plait process group: `init_process_group(backend="plait", pg_options=PlaitOptions(...))`.

Every field may also come from the environment (read when the group is created); an explicit
option wins over the environment, which wins over torch's group timeout only for `timeout`. The
environment is read, and the core's own settings parsed, by the core (`_core.setting`,
`_core.env_config`, `_core.wire_name`): the same spellings work here and in the direct API.
"""

import dataclasses
import datetime

from .. import _core
from .._core import ConfigError

_INLINE = ("auto", "always", "never")
_LINKS = ("shared", "own")


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
    subgroup_links "shared": a group over ranks of an existing plait group (new_group, DeviceMesh)
                   uses that group's connections, which makes creating it nearly free; "own": it
                   opens and probes its own. Env PLAIT_TORCH_SUBGROUP_LINKS.
    schedules      custom schedules (docs/schedules.md): a path or a list of paths of schedule
                   files and directories of them. Env PLAIT_SCHEDULES. A group on an existing
                   group's connections (subgroup_links "shared") has that group's schedules.
    """

    timeout: object = None
    algo: object = None
    wire_dtype: object = None
    inline: str = None
    inline_bytes: int = None
    force_staging: bool = None
    staging_cache_bytes: int = None
    subgroup_links: str = None
    schedules: object = None

    def resolved(self, torch_timeout):
        """A copy with every field filled from the environment and defaults; validates."""
        o = dataclasses.replace(self)
        if isinstance(o.timeout, datetime.timedelta):
            o.timeout = o.timeout.total_seconds()
        if o.timeout is None:
            t = torch_timeout.total_seconds() if isinstance(torch_timeout, datetime.timedelta) else torch_timeout
            try:
                from torch.distributed.constants import default_pg_timeout
                is_default = torch_timeout == default_pg_timeout
            except Exception:  # pragma: no cover
                is_default = False
            if (is_default or t is None or t <= 0) and _core.setting("PLAIT_TIMEOUT"):
                t = _core.env_config()["timeout"]
            o.timeout = t
        if o.timeout is not None:
            try:
                o.timeout = _core.check_argument("timeout", o.timeout, "plait")
            except _core.InvalidArgumentError as e:
                raise ConfigError(str(e)) from None
        if o.algo is None:
            o.algo = _core.setting("PLAIT_ALGO")
        if o.wire_dtype is None:
            o.wire_dtype = _core.setting("PLAIT_WIRE_DTYPE")
        if o.wire_dtype is not None and not isinstance(o.wire_dtype, str):
            raise ConfigError(f"plait: wire_dtype must be a name such as 'bf16', got {o.wire_dtype!r}")
        wire = _core.wire_name(o.wire_dtype or "native")
        o.wire_dtype = None if wire == "native" else wire
        if o.inline is None:
            o.inline = _core.setting("PLAIT_TORCH_INLINE") or "auto"
        if o.inline not in _INLINE:
            raise ConfigError(f"plait: inline must be one of {', '.join(_INLINE)}, got {o.inline!r}")
        if o.inline_bytes is None:
            o.inline_bytes = int(_number_env("PLAIT_TORCH_INLINE_BYTES", 1 << 20))
        else:
            o.inline_bytes = _option_number(o.inline_bytes, "inline_bytes", "PLAIT_TORCH_INLINE_BYTES")
        if o.force_staging is None:
            o.force_staging = (_core.setting("PLAIT_TORCH_STAGING") or "").strip().lower() in ("1", "true", "yes", "on")
        if o.staging_cache_bytes is None:
            o.staging_cache_bytes = int(_number_env("PLAIT_TORCH_STAGING_CACHE", 256 << 20))
        else:
            o.staging_cache_bytes = _option_number(o.staging_cache_bytes, "staging_cache_bytes", "PLAIT_TORCH_STAGING_CACHE")
        if o.schedules is not None:
            from ..schedule import paths_setting

            o.schedules = paths_setting(o.schedules, "plait: pg_options schedules")
        if o.subgroup_links is None:
            o.subgroup_links = _core.setting("PLAIT_TORCH_SUBGROUP_LINKS") or "shared"
        if o.subgroup_links not in _LINKS:
            raise ConfigError(f"plait: subgroup_links must be one of {', '.join(_LINKS)}, got {o.subgroup_links!r}")
        return o


def _number_env(name, default):
    """A numeric setting as the core parses it (ConfigError naming it and its range)."""
    v = _core.setting(name)
    return default if v is None else _core.check_setting(name, v)


def _option_number(value, name, env):
    """An explicit option checked against its setting's range."""
    try:
        return int(_core.check_setting(env, str(value)))
    except ConfigError as e:
        raise ConfigError(f"plait: {name} ({e})") from None


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
