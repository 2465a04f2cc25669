"""Helpers for commands that start local ranks on this machine (demo, bench, doctor --local)."""

import json
import socket


def free_port() -> int:
    """A free TCP port on loopback, for MASTER_PORT of local ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json_lines(rank, stream, events):
    """Forwards every JSON line a rank prints as (rank, object); (rank, None) at end of stream.
    Other lines (warnings, tracebacks) are skipped: the rank's exit status reports failure."""
    for line in stream:
        try:
            events.put((rank, json.loads(line)))
        except ValueError:
            pass
    events.put((rank, None))
