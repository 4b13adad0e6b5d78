"""How an agent hands its group's events to the control plane: one batch per POST.

The agent posts an :class:`IngestBatch` to :data:`INGEST_PATH` with the bearer token and gets an
:class:`IngestResult` back. Each element of ``events`` is one event of ``protocol.events`` in its
JSON form; the control plane validates them one by one, so a bad event is rejected (and
counted) alone instead of costing the batch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

INGEST_PATH = "/api/v1/ingest"
MAX_BATCH_EVENTS = 10_000
"""The most events one POST may carry: a batch stays well under a second to store."""


class IngestBatch(BaseModel):
    group: int = Field(ge=0, description="the sending agent's group: every event must be of it")
    events: list[dict[str, Any]] = Field(max_length=MAX_BATCH_EVENTS, description="events, oldest first")
    dropped: int = Field(0, ge=0, description="events the agent dropped so far: its buffer was full")


class IngestResult(BaseModel):
    accepted: int
    rejected: int
