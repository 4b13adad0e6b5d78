from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from protocol.events import EVENT_TYPES
from protocol.ingest import INGEST_PATH, IngestBatch, IngestResult
from service.controlplane.deps import ServicesDep, find_group
from service.controlplane.errors import InvalidQuery
from service.controlplane.models import EventPage

router = APIRouter(prefix="/api/v1", tags=["events"])
ingest_router = APIRouter(tags=["agents"])


def _types(type_: list[str] | None) -> list[str] | None:
    unknown = sorted(set(type_ or []) - set(EVENT_TYPES))
    if unknown:
        raise InvalidQuery(f"unknown event type(s) {', '.join(unknown)}; known: {', '.join(EVENT_TYPES)}")
    return type_


@router.get("/events", response_model=EventPage, responses={422: {}})
def list_events(
    s: ServicesDep, group: int | None = Query(None, ge=0), type: list[str] | None = Query(None),
    since: float | None = Query(None, description="Unix time: events at or after it"),
    after_id: int = Query(0, ge=0, description="page after this event id"),
    limit: int = Query(100, ge=1, le=1000),
) -> EventPage:
    """Stored events, oldest first, filtered by group, type and time; paginated by id."""
    events = s.store.events(group, _types(type), since, after_id, limit)
    return EventPage(events=events, next_after_id=events[-1]["id"] if len(events) == limit else None)


@router.get("/events/stream", responses={422: {}})
async def stream_events(request: Request, s: ServicesDep, group: int | None = Query(None, ge=0),
                        type: list[str] | None = Query(None)) -> StreamingResponse:
    """Server-sent events: every new event as it arrives (``data:`` lines of JSON)."""
    wanted = _types(type)
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
                    yield f"id: {stored.id}\nevent: {e.type}\ndata: {json.dumps(stored.as_json())}\n\n"
        finally:
            s.bus.unsubscribe(queue)

    return StreamingResponse(feed(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@ingest_router.post(INGEST_PATH, response_model=IngestResult, responses={404: {}})
async def ingest(body: IngestBatch, s: ServicesDep) -> IngestResult:
    """Agents post their group's events here in batches.

    Async on purpose: it runs on the event loop, which owns the listeners' asyncio queues.
    """
    find_group(s, body.group)
    return s.ingest.ingest(body)
