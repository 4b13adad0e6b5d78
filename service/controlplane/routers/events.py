from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from protocol.events import INT64_MAX, EventType
from protocol.ingest import INGEST_PREFIX, IngestBatch, IngestResult
from service.controlplane.deps import AdmittedGroupDep, AuthorizedDep, ServicesDep, redacted
from service.controlplane.models import EventPage

router = APIRouter(prefix="/api/v1", tags=["events"])
ingest_router = APIRouter(tags=["agents"])


GroupQuery = Annotated[int | None, Query(ge=0, le=INT64_MAX, description="only this group's events")]
TypesQuery = Annotated[list[EventType] | None, Query(description="only events of these types")]


@router.get("/events", response_model=EventPage, responses={422: {}})
def list_events(
    s: ServicesDep, authorized: AuthorizedDep, group: GroupQuery = None, type: TypesQuery = None,
    since: float | None = Query(None, allow_inf_nan=False, description="Unix time: events at or after it"),
    after_id: int = Query(0, ge=0, le=INT64_MAX, description="page after this event id"),
    limit: int = Query(100, ge=1, le=1000),
) -> EventPage:
    """Stored events, oldest first, filtered by group, type and time; paginated by id. A start
    event's full replica id comes only with the job's token."""
    events = s.store.events(group, type, since, after_id, limit)
    shown = events if authorized else [redacted(e) for e in events]
    return EventPage(events=shown, next_after_id=events[-1]["id"] if len(events) == limit else None)


@router.get("/events/stream", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}, "description": "an endless stream"}, 422: {}})
async def stream_events(request: Request, s: ServicesDep, authorized: AuthorizedDep, group: GroupQuery = None,
                        type: TypesQuery = None) -> StreamingResponse:
    """Server-sent events: every new event as it arrives (``data:`` lines of JSON; full replica
    ids only with the job's token)."""
    wanted = type
    shown = (lambda fields: fields) if authorized else redacted
    queue = s.bus.subscribe()

    async def feed():
        try:
            yield ": connected\n\n"
            while not await request.is_disconnected():
                try:
                    stored = await asyncio.wait_for(queue.get(), s.settings.stream_keepalive_s)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                e = stored.event
                if (group is None or e.group == group) and (not wanted or e.type in wanted):
                    yield f"id: {stored.id}\nevent: {e.type}\ndata: {json.dumps(shown(stored.as_json()))}\n\n"
        finally:
            s.bus.unsubscribe(queue)

    return StreamingResponse(feed(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@ingest_router.post(INGEST_PREFIX + "{group}", response_model=IngestResult, responses={409: {}, 422: {}, 503: {}})
async def ingest(group: AdmittedGroupDep, body: IngestBatch, s: ServicesDep) -> IngestResult:
    """Agents post their group's events here in batches. Each invalid event is rejected alone
    (counted, with a line of why); the rest are stored together, once each (by ``eid``).

    A group number not seen before joins the job (the path's token is that group's), up to
    ``--max-groups``; ``agent_registered`` tells the agent whether its address is known here.

    The batch is stored with the others that arrive meanwhile, in one transaction, off the event
    loop (``service/controlplane/ingest.py``); the answer comes after the commit.
    """
    s.registry.admit(group)
    result = await s.writer.submit(group, body)
    return result.model_copy(update={"agent_registered": group in s.registry.urls})
