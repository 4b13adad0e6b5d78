"""Where an agent's batch of events enters the control plane.

The whole batch is validated first, on the request: each event against the schema (finite
numbers, 64-bit integers, non-negative counts), its group against the sender's, its time against
this server's clock. A bad event is rejected and counted with a line of why; it never costs the
others. The request then queues its valid events and waits; the writer (:class:`IngestWriter`)
takes every batch queued meanwhile and stores them in one transaction, in a worker thread, so
neither a thousand agents' posts nor SQLite's fsync hold the event loop, and the store commits
a few times a second instead of a thousand. The valid events, each batch's accounting and the
state transitions they cause are written together: all of it is stored, or on a storage error
none of it (the board is rebuilt from the store and every waiting agent gets a 503, so it sends
its batch again). An event whose ``eid`` is stored already (a retry) is counted and skipped.
Only after the commit does every new event, in order, move the metrics, the straggler detector
(whose verdicts are recorded as events in turn) and the listeners on the bus (the SSE stream, a
running drill), on the event loop, which owns the listeners' queues.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from dataclasses import dataclass, field

from pydantic import ValidationError

from protocol.events import EVENT_ADAPTER, Event
from protocol.ingest import MAX_REASONS, IngestBatch, IngestResult, Transport
from service.controlplane.bus import EventBus, StoredEvent
from service.controlplane.db import Store
from service.controlplane.errors import Overloaded, StorageUnavailable
from service.controlplane.coverage import CoverageLedger
from service.controlplane.groups import GroupBoard
from service.controlplane.metrics import JobMetrics
from service.controlplane.stragglers import StragglerTracker

log = logging.getLogger("controlplane.ingest")


def why_invalid(err: ValidationError) -> str:
    """The first error of a validation, in one line."""
    first = err.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


class Ingestor:
    def __init__(self, store: Store, board: GroupBoard, metrics: JobMetrics, bus: EventBus,
                 stragglers: StragglerTracker, max_clock_skew_s: float, max_event_age_s: float,
                 coverage: CoverageLedger):
        self.store = store
        self.board = board
        self.coverage = coverage
        self.metrics = metrics
        self.bus = bus
        self.stragglers = stragglers
        self.max_clock_skew_s = max_clock_skew_s
        self.max_event_age_s = max_event_age_s

    def _check(self, raw: dict, group: int, now: float) -> Event | str:
        """The event, or why it is refused."""
        try:
            event = EVENT_ADAPTER.validate_python(raw)
        except ValidationError as err:
            return why_invalid(err)
        if event.group != group:
            return f"group: an event of group {event.group} in a batch of group {group}"
        if event.ts > now + self.max_clock_skew_s:
            return (f"ts: {event.ts - now:.0f} s ahead of the control plane's clock (more than "
                    f"--max-clock-skew-s {self.max_clock_skew_s:g}); check the sender's clock")
        if event.ts < now - self.max_event_age_s:
            return f"ts: older than --max-event-age-s {self.max_event_age_s:g}"
        return event

    def check_batch(self, group: int, batch: IngestBatch) -> "Checked":
        """The batch's valid events and the reasons the others were refused."""
        now = time.time()
        checked = Checked(group, batch.dropped)
        for raw in batch.events:
            event = self._check(raw, group, now)
            if isinstance(event, str):
                checked.reasons.append(event)
            else:
                checked.events.append(event)
        return checked

    def commit(self, batches: list["Checked"]) -> list[list[tuple[int, Event]]]:
        """One transaction for every batch: its events, its accounting, the transitions they cause
        (``None`` group: events the control plane decided itself, no accounting). Returns each
        batch's new events with their ids. Safe in a worker thread: the board changes under the
        store's lock. A storage error rebuilds the board and raises :class:`StorageUnavailable`."""
        try:
            with self.store.transaction():
                stored = []
                for b in batches:
                    ids = self.store.add_events(b.events)
                    new = [(event_id, event) for event_id, event in zip(ids, b.events) if event_id is not None]
                    for _, event in new:
                        self.board.observe(event)
                        self.coverage.observe(event)
                    if b.group is not None:
                        self.store.record_ingest(b.group, b.dropped, len(b.reasons),
                                                 duplicates=len(b.events) - len(new))
                    stored.append(new)
                return stored
        except sqlite3.Error as err:
            self.board.restore()
            raise StorageUnavailable(f"the control plane could not store the events ({err}); nothing was "
                                     "stored, send them again") from err

    def publish(self, new: list[tuple[int, Event]]) -> None:
        """On the event loop, after the commit: the metrics, the straggler detector, the bus."""
        verdicts = []
        for event_id, event in new:
            self.metrics.observe(event)
            verdicts += self.stragglers.observe(event)
            self.bus.publish(StoredEvent(event_id, event))
        if verdicts:
            self.record(verdicts)

    def record(self, events: list[Event]) -> int:
        """Store and publish events the control plane decided itself (a lost group, a straggler),
        at once; returns how many were new."""
        new = self.commit([Checked(None, 0, events)])[0]
        self.publish(new)
        return len(new)


@dataclass
class Checked:
    """A batch, validated: the events to store and why the others were refused."""

    group: int | None
    dropped: int
    events: list[Event] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def result(self, stored: int) -> IngestResult:
        return IngestResult(accepted=stored, rejected=len(self.reasons), duplicates=len(self.events) - stored,
                            reasons=self.reasons[:MAX_REASONS])


@dataclass
class _Waiting:
    checked: Checked
    answer: asyncio.Future


class IngestWriter:
    """Stores the agents' batches together. A request's batch waits at most ``linger_s`` for
    others to join it, then all that are queued go to SQLite in one transaction, in a worker
    thread; at most ``max_events`` events go in one transaction, the rest in the next. Past
    ``max_queued_events`` waiting, a post is refused at once (503): its agent keeps the events and
    backs off, instead of every agent's retries piling up behind a store that is behind."""

    def __init__(self, ingestor: Ingestor, linger_s: float = 0.02, max_events: int = 5_000,
                 max_queued_events: int = 20_000):
        self.ingestor = ingestor
        self.linger_s = linger_s
        self.max_events = max_events
        self.max_queued_events = max_queued_events
        self._queue: list[_Waiting] = []
        self._queued_events = 0
        self._wake = asyncio.Event()

    async def submit(self, group: int, batch: IngestBatch, transport: Transport) -> IngestResult:
        """The batch's result once it is stored. Past ``max_queued_events`` waiting (the store is
        behind), a :class:`Overloaded` at once: the agent keeps its events and backs off."""
        self.ingestor.metrics.batches.labels(transport).inc()
        if self._queued_events >= self.max_queued_events:
            raise Overloaded(f"the control plane has {self._queued_events} events waiting to be stored; "
                             "send them again later")
        checked = self.ingestor.check_batch(group, batch)
        self._queued_events += len(checked.events)
        waiting = _Waiting(checked, asyncio.get_running_loop().create_future())
        self._queue.append(waiting)
        self._wake.set()
        return await waiting.answer

    def _take(self) -> list[_Waiting]:
        taken, events = [], 0
        while self._queue and (not taken or events + len(self._queue[0].checked.events) <= self.max_events):
            events += len(self._queue[0].checked.events)
            taken.append(self._queue.pop(0))
        self._queued_events -= events
        return taken

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.linger_s)
            self._wake.clear()
            while taken := self._take():
                await self._write(taken)

    async def _write(self, taken: list[_Waiting]) -> None:
        try:
            stored = await asyncio.to_thread(self.ingestor.commit, [w.checked for w in taken])
        except Exception as err:  # the writer outlives any one write; every waiting agent sends again
            if not isinstance(err, StorageUnavailable):
                log.exception("storing %d batches failed", len(taken))
                err = StorageUnavailable(f"the control plane could not store the events ({type(err).__name__}); "
                                         "nothing was stored, send them again")
            for w in taken:
                if not w.answer.done():
                    w.answer.set_exception(err)
            return
        for w, new in zip(taken, stored):
            self.ingestor.publish(new)
            if not w.answer.done():  # the agent may have hung up meanwhile: its batch is stored
                w.answer.set_result(w.checked.result(len(new)))
            await asyncio.sleep(0)  # requests are served between the batches, never held behind all of them
