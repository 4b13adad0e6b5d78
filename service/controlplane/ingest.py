"""Where an agent's batch of events enters the control plane.

Each event is validated on its own (a bad one is rejected and counted, the rest go on), the
batch is stored in one transaction, and then every stored event, in order, moves its group's
state on the board (``groups.py``), the metrics, the straggler detector (whose verdicts are
recorded as events in turn) and the listeners on the bus (the SSE stream, a running drill).
"""

from __future__ import annotations

from pydantic import ValidationError

from protocol.events import EVENT_ADAPTER, Event
from protocol.ingest import IngestBatch, IngestResult
from service.controlplane.bus import EventBus, StoredEvent
from service.controlplane.db import Store
from service.controlplane.groups import GroupBoard
from service.controlplane.metrics import JobMetrics
from service.controlplane.stragglers import StragglerTracker


class Ingestor:
    def __init__(self, store: Store, board: GroupBoard, metrics: JobMetrics, bus: EventBus,
                 stragglers: StragglerTracker):
        self.store = store
        self.board = board
        self.metrics = metrics
        self.bus = bus
        self.stragglers = stragglers

    def ingest(self, batch: IngestBatch) -> IngestResult:
        accepted: list[Event] = []
        for raw in batch.events:
            try:
                event = EVENT_ADAPTER.validate_python(raw)
            except ValidationError:
                continue
            if event.group == batch.group:
                accepted.append(event)
        rejected = len(batch.events) - len(accepted)
        self.record(accepted)
        self.store.record_ingest(batch.group, batch.dropped, rejected)
        self.metrics.rejected.inc(rejected)
        return IngestResult(accepted=len(accepted), rejected=rejected)

    def record(self, events: list[Event]) -> None:
        """Store valid events and fold them into the board, the metrics and the bus: an agent's,
        or one the control plane decided itself (a lost group, a straggler)."""
        ids = self.store.add_events(events)
        verdicts = []
        for event_id, event in zip(ids, events):
            self.metrics.observe(event)
            self.board.observe(event)
            verdicts += self.stragglers.observe(event)
            self.bus.publish(StoredEvent(event_id, event))
        if verdicts:
            self.record(verdicts)
