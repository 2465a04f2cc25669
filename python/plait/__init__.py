"""plait: collective communication over TCP between ordinary machines.

    import plait
    comm = plait.init_from_env()          # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    y = comm.allreduce(np.ones(4, np.float32))
"""

from typing import TYPE_CHECKING

from ._core import (
    AbortedError,
    BrokenError,
    ConfigError,
    EvictedError,
    InvalidArgumentError,
    MismatchError,
    PeerError,
    PeerLost,
    PlaitError,
    PlaitTimeoutError,
    RendezvousError,
)
from ._core import __version__  # the crate's version, which is the package's (maturin)

if TYPE_CHECKING:
    from ._dtypes import supported_dtypes
    from .comm import Communicator, Work
    from .env import init_from_env

# The direct API loads on first use: it needs numpy, which a torch job (the backend registers
# through `import plait` and never touches it) or `plait --help` should not pay for.
_LAZY = {"Communicator": "comm", "Work": "comm", "init_from_env": "env", "supported_dtypes": "_dtypes"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AbortedError",
    "BrokenError",
    "Communicator",
    "ConfigError",
    "EvictedError",
    "InvalidArgumentError",
    "MismatchError",
    "PeerError",
    "PeerLost",
    "PlaitError",
    "PlaitTimeoutError",
    "RendezvousError",
    "Work",
    "__version__",
    "init_from_env",
    "supported_dtypes",
]

from . import _torch_hook  # noqa: E402

_torch_hook.install()
