"""The defaults every process of the job agrees on, each with the reason it has its value.

The trainer, the agents, the Lighthouse wrapper, the control plane and ``ftctl up`` all start
from these; a deployment that changes one passes it to every process that needs it.
"""

from __future__ import annotations

LOOPBACK = "127.0.0.1"
"""Where everything binds unless told otherwise: nothing of a job is reachable from outside."""

LIGHTHOUSE_PORT = 29510
"""torchft's Lighthouse: gRPC for the Managers and its HTML pages, on one port (torchft's own example)."""

LIGHTHOUSE_API_PORT = 29511
"""The Lighthouse wrapper's JSON status, health and metrics: the port beside the Lighthouse's."""

CONTROL_PLANE_PORT = 8000
"""The control plane's REST API, page and metrics."""

HEARTBEAT_TIMEOUT_MS = 1000
"""A replica group silent this long is dead to the Lighthouse: the failure-detection time T_d.
torchft's default is 5000; the Managers heartbeat every 100 ms, so 1 s is ten missed beats."""

JOIN_TIMEOUT_MS = 1000
"""How long a new quorum waits for heartbeating groups that have not asked to join. torchft's CLI
default is 60000, which would stall the survivors for a minute whenever a group returns."""

QUORUM_TICK_MS = 100
"""How often the Lighthouse re-checks for a quorum (torchft's default)."""

RANKS_PER_GROUP = 2
"""Ranks (torchrun processes) in one replica group: the smallest group FSDP2 really shards over."""


def lighthouse_address(host: str = LOOPBACK, port: int = LIGHTHOUSE_PORT) -> str:
    """The Lighthouse as a trainer's Manager dials it."""
    return f"http://{host}:{port}"
