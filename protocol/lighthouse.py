"""What the Lighthouse wrapper serves (``python -m lighthouse``) and the control plane reads.

torchft's Lighthouse has no JSON view: the wrapper parses its ``/status`` page into
:class:`LighthouseStatus` (``protocol/lighthouse_status.py``, pinned to torchft 0.2.0's page) and serves
it at :data:`STATUS_PATH`; :data:`HEALTH_PATH` answers :class:`LighthouseHealth`. A ``POST`` of
:class:`LighthouseKill` to :data:`KILL_PATH`, with the job's bearer token, SIGKILLs the
Lighthouse process and holds its restart (the Lighthouse drill) and answers :class:`LighthouseKilled`.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from pydantic import BaseModel, Field

from protocol.health import Served

STATUS_PATH = "/status"
HEALTH_PATH = "/healthz"
KILL_PATH = "/kill"


class QuorumMember(BaseModel):
    replica_id: str = Field(description="torchft replica id: name:uuid, new on every start")
    group: int | None = Field(description="stable replica-group id, from the name's trailing digits")
    step: int
    manager_address: str
    store_address: str
    world_size: int
    recovering: bool


class Heartbeat(BaseModel):
    replica_id: str
    group: int | None
    age_s: float
    stale: bool = Field(description="the Lighthouse marks it old (past its heartbeat timeout)")


class NextQuorum(BaseModel):
    text: str = Field(description="the Lighthouse's own words, e.g. 'Fast quorum found! ...'")
    healthy_participants: int | None = None
    participants: int | None = None
    heartbeating: int | None = None


class LighthouseStatus(BaseModel):
    quorum_id: int
    next_quorum: NextQuorum
    previous_quorum_id: int | None = None
    quorum_age_s: float | None = None
    members: list[QuorumMember] = []
    heartbeats: list[Heartbeat] = []


class LighthouseHealth(Served):
    ok: bool = Field(description="the Lighthouse process runs and answers its status page")
    pid: int | None = Field(description="the torchft Lighthouse's own process")
    restarts: int = Field(description="times the wrapper restarted a dead Lighthouse")
    lighthouse_url: str
    error: str | None = None


MAX_HOLD_S = 3600.0


class LighthouseKill(BaseModel):
    down_s: float = Field(0.0, ge=0, le=MAX_HOLD_S, description="keep it down at least this long before the "
                          "wrapper restarts it (its restart delay applies when shorter)")


class LighthouseKilled(BaseModel):
    pid: int = Field(description="the Lighthouse process that was SIGKILLed")
    killed_at: float = Field(description="Unix time of the signal")
    restart_at: float = Field(description="when the wrapper will start a new one")


def lighthouse_endpoint(address: str) -> tuple[str, int]:
    """The host and port of a Lighthouse address, ``host:port`` or ``http://host:port``. Raises
    ValueError for an address that is neither."""
    parts = urlsplit(address if "://" in address else f"http://{address}")
    if not parts.hostname or not parts.port:
        raise ValueError(f"--lighthouse {address!r} is not host:port or http://host:port")
    return parts.hostname, parts.port


def status_url(address: str) -> str:
    """The URL of torchft's own status page of the Lighthouse at ``address`` (as
    :func:`lighthouse_endpoint` takes it)."""
    host, port = lighthouse_endpoint(address)
    scheme = urlsplit(address).scheme if "://" in address else "http"
    return f"{scheme}://{host}:{port}{STATUS_PATH}"


def lighthouse_unreachable(address: str, timeout_s: float) -> str | None:
    """Why torchft's Lighthouse at ``host:port`` (or ``http://host:port``) takes no connection, or
    None when it does. Raises ValueError for an address that is neither."""
    try:
        socket.create_connection(lighthouse_endpoint(address), timeout=timeout_s).close()
    except OSError as err:
        return str(err.strerror or err)
    return None
