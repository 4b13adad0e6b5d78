"""How an agent hands its group's events to the control plane: one batch per POST.

The agent posts an :class:`IngestBatch` to :func:`ingest_path` with its group's token and gets an
:class:`IngestResult` back. Each element of ``events`` is one event of ``protocol.events`` in its
JSON form; the control plane validates them all before it stores any, so a bad event is
rejected (and counted, with a line of why) alone instead of costing the batch, and the rest are
stored in one transaction.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

INGEST_PREFIX = "/api/v1/ingest/"


def ingest_path(group: int) -> str:
    """Where group ``group``'s agent posts: its own path, so its token is checked before the body is read."""
    return f"{INGEST_PREFIX}{group}"


def ingest_group(path: str) -> int | None:
    """The group an ingest path is for (None: no ingest path)."""
    tail = path.removeprefix(INGEST_PREFIX)
    return int(tail) if tail != path and tail.isdigit() and len(tail) < 19 else None
MAX_BATCH_EVENTS = 10_000
"""The most events one POST may carry: a batch stays well under a second to store."""
MAX_REASONS = 5


class IngestBatch(BaseModel):
    """The events of the group the path names (:func:`ingest_path`): every event must be of it."""

    events: list[dict[str, Any]] = Field(max_length=MAX_BATCH_EVENTS, description="events, oldest first")
    dropped: int = Field(0, ge=0, description="events the agent dropped so far: its buffer was full")


class IngestResult(BaseModel):
    accepted: int = Field(description="events stored now")
    rejected: int = Field(description="events refused as invalid; never stored, counted per group")
    duplicates: int = Field(0, description="events whose eid was stored already (a retry): stored once")
    reasons: list[str] = Field(default_factory=list, max_length=MAX_REASONS,
                               description="why the first rejected events were refused, one line each")
    agent_registered: bool = Field(True, description="whether the control plane knows the group's agent "
                                   "address; false: the agent registers again (protocol/registration.py)")
