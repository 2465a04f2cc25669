"""Type stub of `plait._core`, the PyO3 bindings over plait-core (crates/plait-py/src/lib.rs).

Buffers cross as (address, byte count): the caller keeps the memory alive and untouched until
the returned Work has completed. Dtypes, operators and collectives may be given by name or by
the integer code the core lists in DTYPES, OPS and COLLECTIVES.
"""

from typing import Any, Optional, Sequence, Tuple, TypedDict, Union

class DTypeInfo(TypedDict):
    name: str
    code: int
    size: int
    float: bool

class Named(TypedDict):
    name: str
    code: int

class SettingInfo(TypedDict):
    name: str
    kind: str
    default: str
    doc: str
    min: Optional[float]  # the range of a numeric setting (None for text and choices)
    max: Optional[float]

class RouteInfo(TypedDict):
    peer: int
    local: str
    remote: str
    reason: str
    local_iface: str
    same_host: bool
    rtt_us: Optional[float]
    streams: int
    max_streams: int  # the most connections start-up could open to this peer (PLAIT_STREAMS_MAX)
    rx_bytes_per_s: Optional[float]  # bytes/s from the peer to this rank, measured at start-up (PLAIT_MEASURE)
    via: Optional[int]  # the rank this link's frames go through, for a peer this rank cannot connect to (PLAIT_RELAY)
    shm_lanes: int  # connections whose payloads over 64 KiB go through shared memory (PLAIT_SHM_BYTES, ranks of one host)

class InterfaceInfo(TypedDict):
    name: str
    ip: str
    prefix: int
    mtu: Optional[int]
    speed_mbps: Optional[int]

NameOrCode = Union[str, int]

DTYPES: Tuple[DTypeInfo, ...]
OPS: Tuple[Named, ...]
COLLECTIVES: Tuple[Named, ...]
WIRES: Tuple[str, ...]
SETTINGS: Tuple[SettingInfo, ...]
RESERVED_TAGS: int
__version__: str

class PlaitError(Exception): ...
class PeerError(PlaitError): ...
class PeerLost(PeerError): ...
class EvictedError(PlaitError): ...
class PlaitTimeoutError(PlaitError, TimeoutError): ...
class AbortedError(PlaitError): ...
class MismatchError(PlaitError): ...
class BrokenError(PlaitError): ...
class RendezvousError(PlaitError): ...
class ConfigError(PlaitError, ValueError): ...
class InvalidArgumentError(PlaitError, ValueError): ...

class Work:
    def wait(self, timeout: Optional[float] = None) -> bool: ...
    def is_completed(self) -> bool: ...
    def source(self) -> int: ...

class Comm:
    rank: int
    size: int
    epoch: int
    group: str
    timeout: float
    threads: str
    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        *,
        timeout: Optional[float] = None,
        group: str = "default",
        epoch: int = 0,
        algo: Optional[str] = None,
        threads: str = "creator",
        schedules: Optional[str] = None,
    ) -> None: ...
    def collective(
        self,
        coll: NameOrCode,
        send_ptr: int,
        send_nbytes: int,
        recv_ptr: int,
        recv_nbytes: int,
        dtype: NameOrCode,
        op: Optional[NameOrCode] = None,
        *,
        factor: Optional[float] = None,
        root: int = 0,
        send_counts: Optional[Sequence[int]] = None,
        recv_counts: Optional[Sequence[int]] = None,
        timeout: Optional[float] = None,
        algo: Optional[str] = None,
        inline: bool = False,
        wire: Optional[str] = None,
    ) -> Work: ...
    def send(self, ptr: int, nbytes: int, dtype: NameOrCode, dst: int, tag: int = 0, *, timeout: Optional[float] = None, inline: bool = False) -> Work: ...
    def recv(self, ptr: int, nbytes: int, dtype: NameOrCode, src: int, tag: int = 0, *, timeout: Optional[float] = None, inline: bool = False) -> Work: ...
    def barrier(self, *, timeout: Optional[float] = None, inline: bool = False) -> Work: ...
    def subgroup(self, name: str, ranks: Sequence[int], *, timeout: Optional[float] = None, algo: Optional[str] = None) -> Comm: ...
    def refuse(self, reason: str) -> int:
        """This rank refuses its next collective: it takes that call's sequence number, and the
        other ranks' part of the call fails with `reason` (an InvalidArgumentError naming this
        rank) instead of waiting. The communicator stays usable. Returns the sequence number."""
    def abort(self, reason: str = "abort() called") -> None: ...
    def close(self) -> None: ...
    def algorithm_for(self, coll: NameOrCode, nbytes: int, root: int = 0) -> str: ...
    def predict(self, coll: NameOrCode, nbytes: int, root: int = 0, algo: Optional[str] = None) -> tuple[float, str]: ...
    def fit_cost_model(self, runs: list[tuple[NameOrCode, str, int, int, float]]) -> dict[str, Any]: ...
    def routes(self) -> list[RouteInfo]: ...
    def ring_order(self) -> list[int]: ...
    def link_matrix(self) -> Optional[tuple[list[list[Optional[float]]], list[list[Optional[float]]]]]: ...
    def topology(self) -> str: ...
    def listen_port(self) -> Optional[int]: ...

class Elastic:
    """A member of an elastic group (plait.elastic); rank, size and epoch are the current view's."""
    rank: int
    size: int
    epoch: int
    members: list[str]
    member_id: str
    contact: str
    contacts: list[str]
    timeout: float
    def __init__(
        self,
        *,
        peers: Sequence[str] = ...,
        listen: str = "0.0.0.0:0",
        group: str = "default",
        timeout: Optional[float] = None,
        heartbeat_timeout: Optional[float] = None,
        witness: Optional[str] = None,
        dial_timeout: Optional[float] = None,
    ) -> None: ...
    def pending(self) -> int: ...
    def collective(
        self,
        coll: NameOrCode,
        send_ptr: int,
        send_nbytes: int,
        recv_ptr: int,
        recv_nbytes: int,
        dtype: NameOrCode,
        op: Optional[NameOrCode] = None,
        *,
        factor: Optional[float] = None,
        root: int = 0,
        send_counts: Optional[Sequence[int]] = None,
        recv_counts: Optional[Sequence[int]] = None,
        timeout: Optional[float] = None,
        algo: Optional[str] = None,
        inline: bool = True,
        wire: Optional[str] = None,
    ) -> Work: ...
    def update(self) -> bool: ...
    def close(self) -> None: ...

class Witness:
    """A witness for one elastic group: one more vote in every view change."""
    contact: str
    def __init__(self, *, listen: str, group: str = "default", heartbeat_timeout: Optional[float] = None) -> None: ...
    def view(self) -> Tuple[int, int]: ...
    def close(self) -> None: ...

def algorithms(coll: NameOrCode) -> list[str]: ...
def schedule_file(coll: NameOrCode, algo: str, nranks: int, root: int = 0, name: Optional[str] = None) -> str: ...
def check_schedule(text: str, origin: str = "<schedule>", custom: bool = True) -> dict[str, Any]: ...
def estimate_schedule(text: str, sizes: Sequence[int], *, topology: str = "shared", hosts: int = 1, cost_model: Optional[str] = None,
                      segment_bytes: int = 1048576, origin: str = "<schedule>") -> list[float]: ...
def interfaces() -> list[InterfaceInfo]: ...
def host_identity() -> Optional[str]: ...
def chunk_hashes(ptr: int, nbytes: int, chunk: int) -> bytes: ...
def wire_round_trip(wire: str, ptr: int, nbytes: int) -> int: ...
def wire_bytes(wire: str, elems: int) -> int: ...
def check_op(op: NameOrCode, dtype: NameOrCode, factor: Optional[float] = None) -> Tuple[str, Optional[float]]: ...
def setting(name: str) -> Optional[str]: ...
def env_config() -> dict[str, Any]: ...
def wire_name(name: str) -> str: ...
def check_argument(name: str, value: Any, what: str = "") -> Any: ...
def check_setting(name: str, text: str) -> float: ...
