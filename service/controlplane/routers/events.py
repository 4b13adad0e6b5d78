from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from protocol.events import EVENT_TYPES
from service.controlplane.deps import Services, services
from service.controlplane.models import EventPage, IngestIn, IngestOut

router = APIRouter(prefix="/api/v1", tags=["events"])
ingest_router = APIRouter(prefix="/api/v1", tags=["agents"])


def _types(type_: list[str] | None) -> list[str] | None:
    unknown = sorted(set(type_ or []) - set(EVENT_TYPES))
    if unknown:
        raise HTTPException(422, f"unknown event type(s) {', '.join(unknown)}; known: {', '.join(EVENT_TYPES)}")
    return type_


@router.get("/events", response_model=EventPage)
def list_events(
    group: int | None = Query(None, ge=0), type: list[str] | None = Query(None),
    since: float | None = Query(None, description="Unix time: events at or after it"),
    after_id: int = Query(0, ge=0, description="page after this event id"),
    limit: int = Query(100, ge=1, le=1000), s: Services = Depends(services),
) -> EventPage:
    """Stored events, oldest first, filtered by group, type and time; paginated by id."""
    events = s.store.events(group, _types(type), since, after_id, limit)
    return EventPage(events=events, next_after_id=events[-1]["id"] if len(events) == limit else None)


@router.get("/events/stream")
async def stream_events(request: Request, group: int | None = Query(None, ge=0),
                        type: list[str] | None = Query(None), s: Services = Depends(services)):
    """Server-sent events: every new event as it arrives (``data:`` lines of JSON)."""
    wanted = _types(type)
    queue = s.hub.subscribe()

    async def feed():
        try:
            yield ": connected\n\n"
            while not await request.is_disconnected():
                try:
                    event = await asyncio.wait_for(queue.get(), 10.0)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if (group is None or event["group"] == group) and (not wanted or event["type"] in wanted):
                    yield f"id: {event['id']}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n"
        finally:
            s.hub.unsubscribe(queue)

    return StreamingResponse(feed(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@ingest_router.post("/ingest", response_model=IngestOut)
async def ingest(body: IngestIn, s: Services = Depends(services)) -> IngestOut:
    """Agents post their group's events here in batches.

    Async on purpose: it runs on the event loop, which owns the listeners' asyncio queues.
    """
    if body.group not in s.hub.views:
        raise HTTPException(404, f"no replica group {body.group}")
    accepted, rejected = s.hub.ingest(body.group, body.events, body.dropped)
    return IngestOut(accepted=accepted, rejected=rejected)
