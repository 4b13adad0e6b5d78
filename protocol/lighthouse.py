"""What the Lighthouse wrapper serves (``python -m lighthouse``) and the control plane reads.

torchft's Lighthouse has no JSON view: the wrapper parses its ``/status`` page into
:class:`LighthouseStatus` (``lighthouse/status.py``, pinned to torchft 0.2.0's page) and serves
it at :data:`STATUS_PATH`; :data:`HEALTH_PATH` answers :class:`LighthouseHealth`.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

STATUS_PATH = "/status"
HEALTH_PATH = "/healthz"


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


class LighthouseHealth(BaseModel):
    ok: bool = Field(description="the Lighthouse process runs and answers its status page")
    pid: int | None
    restarts: int = Field(description="times the wrapper restarted a dead Lighthouse")
    lighthouse_url: str
    error: str | None = None
