from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Query, Request, WebSocket
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from protocol import api
from protocol.events import JSON_INT_MAX, EventType
from protocol.ingest import IngestBatch, IngestResult, StreamAnswer, Transport
from service.controlplane.deps import (
    AdmittedGroupDep,
    AuthorizedDep,
    GroupPath,
    Services,
    ServicesDep,
    admissible,
)
from service.controlplane.errors import DomainError
from service.controlplane.ingest import why_invalid
from service.controlplane.models import EventPage
from service.controlplane.presenters import redacted

router = APIRouter(tags=["events"])
ingest_router = APIRouter(tags=["agents"])
stream_router = APIRouter()


GroupQuery = Annotated[int | None, Query(ge=0, le=JSON_INT_MAX, description="only this group's events")]
TypesQuery = Annotated[list[EventType] | None, Query(description="only events of these types")]


@router.get(api.EVENTS, response_model=EventPage, responses={422: {}})
def list_events(
    s: ServicesDep, authorized: AuthorizedDep, group: GroupQuery = None, type: TypesQuery = None,
    since: float | None = Query(None, allow_inf_nan=False, description="Unix time: events at or after it"),
    after_id: int = Query(0, ge=0, le=JSON_INT_MAX, description="page after this event id"),
    limit: int = Query(100, ge=1, le=1000),
) -> EventPage:
    """Stored events, oldest first, filtered by group, type and time; paginated by id. A start
    event's full replica id comes only with the job's token."""
    events = s.store.events(group, type, since, after_id, limit)
    shown = events if authorized else [redacted(e) for e in events]
    return EventPage(events=shown, next_after_id=events[-1]["id"] if len(events) == limit else None)


@router.get(api.EVENTS_STREAM, response_class=StreamingResponse,
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


@ingest_router.post(api.INGEST, response_model=IngestResult, responses={409: {}, 422: {}, 503: {}})
async def ingest(group: AdmittedGroupDep, body: IngestBatch, s: ServicesDep) -> IngestResult:
    """Agents post their group's events here in batches. Each invalid event is rejected alone
    (counted, with a line of why); the rest are stored together, once each (by ``eid``).

    A group number not seen before joins the job (the path's token is that group's), up to
    ``--max-groups``; ``agent_registered`` tells the agent whether its address is known here.

    The batch is stored with the others that arrive meanwhile, in one transaction, off the event
    loop (``service/controlplane/ingest.py``); the answer comes after the commit.
    """
    return await _store(s, group, body, "post")


async def _store(s: Services, group: int, batch: IngestBatch, transport: Transport) -> IngestResult:
    s.registry.admit(group)
    result = await s.writer.submit(group, batch, transport)
    return result.model_copy(update={"agent_registered": group in s.registry.urls,
                                     "send_every_s": len(s.board.views) / s.settings.max_batches_per_s})


@stream_router.websocket(api.INGEST_STREAM)
async def ingest_stream(websocket: WebSocket, group: GroupPath, s: ServicesDep) -> None:
    """An agent's stream: one batch per message, one :class:`StreamAnswer` per batch, in order.
    A group beyond ``--max-groups`` is refused at the handshake (its agent's POST says why)."""
    try:
        admissible(s, group)
    except DomainError as err:
        await websocket.close(code=1008, reason=str(err)[:120])
        return
    await websocket.accept()
    while (message := await websocket.receive())["type"] != "websocket.disconnect":
        text = message.get("text") or message.get("bytes") or b""  # a binary frame is read as UTF-8 JSON too
        await websocket.send_text((await _answer(s, group, text)).model_dump_json())


async def _answer(s: Services, group: int, text: str | bytes) -> StreamAnswer:
    """What a POST of the message would have answered, as a message."""
    try:
        batch = IngestBatch.model_validate_json(text)
    except ValidationError as err:
        return StreamAnswer(status=422, detail=f"no ingest batch: {why_invalid(err)}")
    try:
        return StreamAnswer(status=200, result=await _store(s, group, batch, "stream"))
    except DomainError as err:
        return StreamAnswer(status=err.status, detail=str(err))
