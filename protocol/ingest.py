"""How an agent hands its group's events to the control plane: batches, on a stream or by POST.

The agent opens a WebSocket at :func:`ingest_stream_path` with its group's token and sends one
:class:`IngestBatch` per message; the control plane answers each with a :class:`StreamAnswer`, in
order, before the agent sends the next. The same batch can be POSTed to :func:`ingest_path`
instead, answered by an :class:`IngestResult` (or an error status with a ``detail``): agents use
that when the stream cannot be opened (a control plane or a proxy without WebSockets; a refused
handshake, whose reason only the POST's answer carries). The stream exists for the group count:
on two cores a thousand agents' POSTs cost the HTTP stack several times what their events cost,
while a message on an open stream costs a tenth of a request.

Each element of ``events`` is one event of ``protocol.events`` in its JSON form; the control plane
validates them all before it stores any, so a bad event is rejected (and counted, with a line of
why) alone instead of costing the batch, and the rest are stored in one transaction.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from protocol import api
from protocol.events import Count

Transport = Literal["stream", "post"]


def ingest_path(group: int) -> str:
    """Where group ``group``'s agent posts: its own path, so its token is checked before the body is read."""
    return api.url(api.INGEST, group=group)


def ingest_stream_path(group: int) -> str:
    """Where group ``group``'s agent opens its stream (a WebSocket), with its group's token."""
    return api.url(api.INGEST_STREAM, group=group)


def ingest_group(path: str) -> int | None:
    """The group an ingest path or stream path is for (None: neither)."""
    prefix, suffix = api.url(api.INGEST, group=""), api.INGEST_STREAM.removeprefix(api.INGEST)
    tail = path.removeprefix(prefix).removesuffix(suffix)
    return int(tail) if path.startswith(prefix) and tail.isdigit() and len(tail) < 19 else None
MAX_BATCH_EVENTS = 10_000
"""The most events one POST may carry: a batch stays well under a second to store."""
MAX_REASONS = 5


class IngestBatch(BaseModel):
    """The events of the group the path names (:func:`ingest_path`): every event must be of it."""

    events: list[dict[str, Any]] = Field(max_length=MAX_BATCH_EVENTS, description="events, oldest first")
    dropped: Count = Field(0, description="events the agent dropped so far: its buffer was full")


class IngestResult(BaseModel):
    accepted: int = Field(description="events stored now")
    rejected: int = Field(description="events refused as invalid; never stored, counted per group")
    duplicates: int = Field(0, description="events whose eid was stored already (a retry): stored once")
    reasons: list[str] = Field(default_factory=list, max_length=MAX_REASONS,
                               description="why the first rejected events were refused, one line each")
    agent_registered: bool = Field(True, description="whether the control plane knows the group's agent "
                                   "address; false: the agent registers again (protocol/registration.py)")
    send_every_s: float | None = Field(None, description="send batches at most this often: the control plane "
                                       "paces its agents so that their batches together stay within what it "
                                       "serves (it grows with the group count); the agent waits the longer of "
                                       "this and its own interval")


class StreamAnswer(BaseModel):
    """The answer to one batch sent on the stream: what a POST of it would have answered."""

    status: int = Field(description="200, or the status a POST would have got: 409 (too many groups), 422 (no "
                        "batch), 503 (the store is behind or failed: send it again later)")
    result: IngestResult | None = Field(None, description="with status 200")
    detail: str | None = Field(None, description="why, with any other status")
