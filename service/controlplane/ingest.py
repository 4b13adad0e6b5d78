"""Where an agent's batch of events enters the control plane.

The whole batch is validated first: each event against the schema (finite numbers, 64-bit
integers, non-negative counts), its group against the sender's, its time against this server's
clock. A bad event is rejected and counted with a line of why; it never costs the others. Then
the valid events, the batch's accounting and the state transitions they cause are written in
one transaction: all of it is stored, or on a storage error none of it (the board is rebuilt
from the store and the agent gets a 503, so it sends the batch again). An event whose ``eid``
is stored already (a retry) is counted and skipped. Only after the commit does every new event,
in order, move the metrics, the straggler detector (whose verdicts are recorded as events in
turn) and the listeners on the bus (the SSE stream, a running drill).
"""

from __future__ import annotations

import sqlite3
import time

from pydantic import ValidationError

from protocol.events import EVENT_ADAPTER, Event
from protocol.ingest import MAX_REASONS, IngestBatch, IngestResult
from service.controlplane.bus import EventBus, StoredEvent
from service.controlplane.db import Store
from service.controlplane.errors import StorageUnavailable
from service.controlplane.groups import GroupBoard
from service.controlplane.metrics import JobMetrics
from service.controlplane.stragglers import StragglerTracker


def _why(err: ValidationError) -> str:
    first = err.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"


class Ingestor:
    def __init__(self, store: Store, board: GroupBoard, metrics: JobMetrics, bus: EventBus,
                 stragglers: StragglerTracker, max_clock_skew_s: float, max_event_age_s: float):
        self.store = store
        self.board = board
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
            return _why(err)
        if event.group != group:
            return f"group: an event of group {event.group} in a batch of group {group}"
        if event.ts > now + self.max_clock_skew_s:
            return (f"ts: {event.ts - now:.0f} s ahead of the control plane's clock (more than "
                    f"--max-clock-skew-s {self.max_clock_skew_s:g}); check the sender's clock")
        if event.ts < now - self.max_event_age_s:
            return f"ts: older than --max-event-age-s {self.max_event_age_s:g}"
        return event

    def ingest(self, group: int, batch: IngestBatch) -> IngestResult:
        now = time.time()
        accepted: list[Event] = []
        reasons: list[str] = []
        for raw in batch.events:
            checked = self._check(raw, group, now)
            if isinstance(checked, str):
                reasons.append(checked)
            else:
                accepted.append(checked)
        stored = self.record(accepted, accounting=(group, batch.dropped, len(reasons)))
        return IngestResult(accepted=stored, rejected=len(reasons), duplicates=len(accepted) - stored,
                            reasons=reasons[:MAX_REASONS])

    def record(self, events: list[Event], accounting: tuple[int, int, int] | None = None) -> int:
        """Store valid events, with ``accounting`` (group, agent's dropped, rejected), and fold the new
        ones into the board, the metrics and the bus: an agent's, or one the control plane decided
        itself (a lost group, a straggler). Returns how many were new."""
        try:
            with self.store.transaction():
                ids = self.store.add_events(events)
                new = [(event_id, event) for event_id, event in zip(ids, events) if event_id is not None]
                for _, event in new:
                    self.board.observe(event)
                if accounting is not None:
                    group, dropped, rejected = accounting
                    self.store.record_ingest(group, dropped, rejected, duplicates=len(events) - len(new))
        except sqlite3.Error as err:
            self.board.restore()
            raise StorageUnavailable(f"the control plane could not store the events ({err}); nothing was "
                                     "stored, send them again") from err
        verdicts = []
        for event_id, event in new:
            self.metrics.observe(event)
            verdicts += self.stragglers.observe(event)
            self.bus.publish(StoredEvent(event_id, event))
        if verdicts:
            self.record(verdicts)
        return len(new)
