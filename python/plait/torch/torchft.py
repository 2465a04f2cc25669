"""plait as torchft's process group: torchft users switch by changing one name.

    from torchft import Manager
    from plait.torch.torchft import ProcessGroupPlait

    manager = Manager(pg=ProcessGroupPlait(), ...)      # instead of ProcessGroupGloo()

torchft (its lighthouse and managers) decides the members of each quorum and calls
`configure(store_addr, replica_id, rank, world_size, ...)` with a store for that quorum; this
class builds a plait group on it (as `init_process_group("plait")` would), so every quorum's
collectives run on plait: faster than gloo, on links gloo cannot find, with the same errors.
Needs `pip install torchft`. Membership stays torchft's; plait's own elastic mode
(`plait.elastic`) needs no lighthouse.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

from torchft.process_group import ProcessGroupWrapper

from .backend import create


class ProcessGroupPlait(ProcessGroupWrapper):
    """torchft's reconfigurable process group, on plait."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)

    def _create_pg(self, store, rank: int, world_size: int):
        quorum = getattr(self, "_quorum_id", None)
        opts = SimpleNamespace(store=store, group_rank=rank, group_size=world_size, timeout=self._timeout,
                               group_id=f"torchft-{quorum if quorum is not None else 0}", global_ranks_in_group=[])
        return create(opts)

    def getBackendName(self) -> str:
        return "torchft-plait"
