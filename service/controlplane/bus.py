"""Stored events fanned out to whoever listens: the SSE stream and the running drill."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from protocol.events import Event


@dataclass(frozen=True)
class StoredEvent:
    """An event as the control plane keeps it: with the id SQLite gave it."""

    id: int
    event: Event

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, **self.event.model_dump(mode="json")}


class EventBus:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._listeners: set[asyncio.Queue[StoredEvent]] = set()

    def publish(self, stored: StoredEvent) -> None:
        for queue in list(self._listeners):
            try:
                queue.put_nowait(stored)
            except asyncio.QueueFull:
                pass  # a slow listener misses events; it never slows ingestion

    def subscribe(self) -> asyncio.Queue[StoredEvent]:
        queue: asyncio.Queue[StoredEvent] = asyncio.Queue(maxsize=self.capacity)
        self._listeners.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[StoredEvent]) -> None:
        self._listeners.discard(queue)

    @staticmethod
    async def wait_for(queue: asyncio.Queue[StoredEvent], predicate: Callable[[Event], bool], timeout_s: float,
                       what: str) -> Event:
        """The first event from ``queue`` that satisfies ``predicate``; TimeoutError says ``what``."""
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate(event := (await queue.get()).event):
                    pass
                return event
        except TimeoutError:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}") from None
