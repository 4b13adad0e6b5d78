"""Where events arrive: stored in SQLite, folded into group views, fanned out to listeners."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from pydantic import ValidationError

from protocol.events import EVENT_ADAPTER
from service.controlplane.db import Store
from service.controlplane.groups import GroupView, Transition
from service.controlplane.metrics import JobMetrics

log = logging.getLogger("controlplane")


class Hub:
    def __init__(self, store: Store, groups: int, metrics: JobMetrics | None = None):
        self.store = store
        self.metrics = metrics or JobMetrics()
        self.views = {g: GroupView(g) for g in range(groups)}
        self._listeners: set[asyncio.Queue] = set()
        self.received = 0
        self.rejected = 0
        self._restore()

    def _restore(self) -> None:
        """Rebuild the views from SQLite after a restart."""
        for g, view in self.views.items():
            for t in self.store.transitions(g):
                view.apply(Transition(t["state"], t["reason"], t["ts"]))
            for type_, rank, where in (("process", None, None), ("heal", 0, None),
                                       ("step", 0, "json_extract(body, '$.committed') = 1")):
                latest = self.store.latest_event(g, type_, rank=rank, where_json=where)
                if latest:
                    view.note(latest)
            view.starts = self.store.count_events(g, "process", "json_extract(body, '$.action') = 'started'")

    def ingest(self, group: int, raw_events: list[dict], agent_dropped: int = 0) -> tuple[int, int]:
        accepted, rejected = [], 0
        for raw in raw_events:
            try:
                event = EVENT_ADAPTER.validate_python(raw)
            except ValidationError:
                rejected += 1
                continue
            if event.group != group or event.group not in self.views:
                rejected += 1
                continue
            accepted.append(event.model_dump())
        ids = self.store.add_events(accepted)
        self.store.record_ingest(group, agent_dropped, rejected)
        self.received += len(accepted)
        self.rejected += rejected
        self.metrics.rejected.inc(rejected)
        for event_id, event in zip(ids, accepted):
            event["id"] = event_id
            self.metrics.observe(event)
            transition = self.views[event["group"]].observe(event)
            if transition is not None:
                self.store.add_transition(event["group"], transition.state, transition.reason, transition.ts)
            self._publish(event)
        return len(accepted), rejected

    def force(self, group: int, state: str, reason: str | None, since: float) -> Transition:
        """A transition the control plane itself decided (it just killed or rejoined the group).

        ``since`` is when the command was sent, not when the agent answered: the group's own
        events (a promoted spare's start, say) can precede the answer and must not look stale.
        """
        transition = Transition(state, reason, since)
        self.views[group].apply(transition)
        self.store.add_transition(group, state, reason, transition.ts)
        return transition

    def _publish(self, event: dict) -> None:
        for queue in list(self._listeners):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                pass  # a slow listener misses events; it never slows ingestion

    def subscribe(self, capacity: int = 10_000) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=capacity)
        self._listeners.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._listeners.discard(queue)

    async def wait_for(self, queue: asyncio.Queue, predicate: Callable[[dict], bool], timeout_s: float,
                       what: str) -> dict:
        """The first event from ``queue`` that satisfies ``predicate``; TimeoutError says ``what``."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            try:
                event = await asyncio.wait_for(queue.get(), remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}") from None
            if predicate(event):
                return event
