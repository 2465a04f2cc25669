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
    skip_torch_flight_recorder_hook(BACKEND_NAME)
    _registered = True


def skip_torch_flight_recorder_hook(backend_name):
    """torch 2.15 attaches a generic flight-recorder hook to every group of a backend not listed
    as recording itself. On a plait group it records nothing (plait's c10d methods are Python
    overrides, which bypass the C++ dispatch the hook sits in) and costs about 18 ms of CPU per
    group, most of a `new_group`. torch's own comment asks a backend's registrar to put its name
    in the set when that is the right answer; plait keeps its own record (`plait trace`)."""
    try:
        from torch.distributed import distributed_c10d as c10d
    except Exception:  # pragma: no cover
        return
    recording_itself = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(recording_itself, set):
        recording_itself.add(backend_name)


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
