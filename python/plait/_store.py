"""torch's TCPStore, made the way this platform needs. Every store plait makes comes from here:
init_from_env (the library) and the local ranks of the tools (plait.tools).

torch's TCPStore on Windows is built without libuv, so `use_libuv=False` there."""

import sys


def tcp_store_kwargs(platform=None):
    """Extra TCPStore arguments this platform needs: torch on Windows has no libuv TCPStore (and
    torch's own env:// rendezvous passes use_libuv=False there too)."""
    return {"use_libuv": False} if (platform or sys.platform) == "win32" else {}


def tcp_store(host, port, world_size=None, is_master=False, **kwargs):
    """torch.distributed.TCPStore(host, port, world_size, is_master, **kwargs), with what this
    platform needs (`tcp_store_kwargs`)."""
    from torch.distributed import TCPStore

    for k, v in tcp_store_kwargs().items():
        kwargs.setdefault(k, v)
    return TCPStore(host, port, world_size, is_master, **kwargs)
