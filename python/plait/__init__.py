"""plait: collective communication over TCP between ordinary machines.

    import plait
    comm = plait.init_from_env()          # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    y = comm.allreduce(np.ones(4, np.float32))
"""

from ._core import (
    AbortedError,
    BrokenError,
    ConfigError,
    InvalidArgumentError,
    MismatchError,
    PeerError,
    PlaitError,
    PlaitTimeoutError,
    RendezvousError,
)
from ._dtypes import supported_dtypes
from .comm import Communicator, Work
from .env import init_from_env


def _version():
    try:
        from importlib.metadata import version

        return version("plait")
    except Exception:  # not installed (running from a source tree)
        return "0+unknown"


__version__ = _version()

__all__ = [
    "AbortedError",
    "BrokenError",
    "Communicator",
    "ConfigError",
    "InvalidArgumentError",
    "MismatchError",
    "PeerError",
    "PlaitError",
    "PlaitTimeoutError",
    "RendezvousError",
    "Work",
    "__version__",
    "init_from_env",
    "supported_dtypes",
]

from . import _torch_hook

_torch_hook.install()
