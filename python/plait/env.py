"""Building a Communicator from the environment torchrun (and most launchers) set."""

from __future__ import annotations

import datetime
import os
from typing import Any

from ._core import ConfigError
from .comm import Communicator


def init_from_env(*, store_timeout: float = 300.0, **kwargs: Any) -> Communicator:
    """A Communicator for RANK of WORLD_SIZE, meeting through a torch TCPStore at
    MASTER_ADDR:MASTER_PORT that rank 0 serves. kwargs go to Communicator (timeout, group, epoch,
    algo)."""
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    missing = [k for k, v in env.items() if not v]
    if missing:
        raise ConfigError(f"init_from_env: environment variable(s) not set: {', '.join(missing)}")
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError as e:
        raise ConfigError(f"init_from_env: RANK, WORLD_SIZE and MASTER_PORT must be integers ({e})") from None
    try:
        from torch.distributed import TCPStore  # noqa: F401
    except ImportError:
        raise ConfigError("init_from_env needs torch for its TCPStore: pip install 'plait[torch]'") from None
    from ._store import tcp_store

    store = tcp_store(
        env["MASTER_ADDR"], port, world, rank == 0,
        timeout=datetime.timedelta(seconds=store_timeout), wait_for_workers=False,
    )
    return Communicator(store, rank, world, **kwargs)
