"""plait as a torch.distributed backend.

    import plait                  # registers the backend (so does `import plait.torch`)
    dist.init_process_group("plait")               # torchrun / env://, tcp://, file://
    dist.init_process_group("cpu:plait,cuda:nccl")  # plait for CPU tensors only

Options: `pg_options=plait.torch.PlaitOptions(timeout=..., algo=..., wire_dtype="bf16")`.
"""

from .options import PlaitOptions

BACKEND_NAME = "plait"
DEVICES = ["cpu", "cuda", "mps"]  # a list: a plain string would be iterated per character

_registered = False


def register():
    """Registers the "plait" backend with torch.distributed (idempotent)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist

    if BACKEND_NAME.upper() not in getattr(dist.Backend, "_plugins", {}):
        from .backend import create

        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=DEVICES)
    _registered = True


def __getattr__(name):
    if name in ("PlaitProcessGroup", "PlaitBackend"):
        from . import backend

        return getattr(backend, name)
    if name == "PlaitWork":
        from .work import PlaitWork

        return PlaitWork
    raise AttributeError(name)


register()

__all__ = ["BACKEND_NAME", "PlaitOptions", "register"]
