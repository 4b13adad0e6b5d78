"""Tails the group's event files and ships them to the control plane in batches.

Training never waits for this: the ranks append to their files, the agent to its own (its
process events), and this thread reads them. What the control plane took is recorded per file
in ``g{g}.shipped`` (atomically, after every batch), so a restarted agent goes on from there:
nothing written while it was down, or read but not yet shipped, is lost. A line shipped twice
(the store committed, the reply was lost) carries the same event id and is stored once.

While the control plane is away, events read wait in a bounded buffer; when it is full the
oldest are dropped and counted. A batch the control plane refuses (a 4xx: it would refuse it
again) is dropped, counted as refused and logged with the reason; a batch too large (413) is
split first. A 5xx or no answer backs off exponentially and sends the same batch again. The
counts are kept across restarts with the offsets. Batches go on the group's stream, or by POST
where it cannot be opened (``service/agent/ingest_channel.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
from pydantic import BaseModel, Field, ValidationError

from protocol.layout import GroupLayout
from protocol.events import (
    Event,
    EventIds,
    ProcessEvent,
    StepEvent,
    parse_event,
    speaks_for_group,
)
from protocol.files import read_model, write_model
from protocol.ingest import IngestBatch
from protocol.registration import AgentRegistration
from service.agent.ingest_channel import IngestChannel
from service.agent.registrar import Registrar

log = logging.getLogger("agent.forwarder")
JOIN_TIMEOUT_S = 10.0
"""At shutdown, the last read and ship of what the group wrote may take this long; what is
not shipped then stays in the files, and the next agent ships it."""
MAX_BACKOFF_S = 5.0
"""A control plane that fails or does not answer is asked again after 1, 2, 4… intervals, at most this."""


class Shipped(BaseModel):
    """What an agent forwarded, kept beside the event files for the agent after it."""

    offsets: dict[str, int] = Field(default_factory=dict, description="file name → bytes shipped, dropped or refused")
    dropped: int = Field(0, ge=0, description="events dropped: the buffer was full")
    refused: int = Field(0, ge=0, description="events the control plane refused with a 4xx")


def shipped_file(events_dir: Path, group: int) -> Path:
    return events_dir / GroupLayout(group).shipped


@dataclass(frozen=True)
class _Read:
    event: Event
    file: str
    end: int
    """the file's offset after this event's line"""


class EventForwarder:
    def __init__(self, group: int, events_dir: Path, control_plane: str | None, token: str,
                 capacity: int, interval_s: float, batch: int, timeout_s: float,
                 on_step: Callable[[StepEvent], None] = lambda step: None,
                 registration: AgentRegistration | None = None):
        """``on_step`` hears every committed step the group's rank 0 writes; with ``registration``
        the agent registers with the control plane from this thread (``service/agent/registrar.py``)."""
        self.group = group
        self.on_step = on_step
        self.events_dir = events_dir
        self.control_plane = control_plane
        self.interval_s = interval_s
        self.batch = batch
        self.buffer: deque[_Read] = deque()
        self.capacity = capacity
        self.shipped = Shipped()
        self.forwarded = 0
        self.invalid = 0
        self.last_step: int | None = None
        self.reachable = False
        self._read_offsets: dict[str, int] = {}
        self._state_path = shipped_file(events_dir, group)
        self._own_path = events_dir / GroupLayout(group).agent_events
        self._ids = EventIds(GroupLayout(group).event_ids(None))
        self._write_lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff_s = interval_s
        self._paced_s = 0.0
        """the control plane's ``send_every_s``: at a thousand groups it asks for fewer batches"""
        self._last_refusal = ""
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})
        self._channel = IngestChannel(control_plane, group, token, self._client, timeout_s) if control_plane else None
        self._thread = threading.Thread(target=self._run, name="event-forwarder", daemon=True)
        self.registrar = Registrar(group, control_plane, registration, MAX_BACKOFF_S) \
            if registration is not None and control_plane else None

    @property
    def dropped(self) -> int:
        return self.shipped.dropped

    @property
    def refused(self) -> int:
        return self.shipped.refused

    def start(self) -> None:
        """Go on where the agent before stopped. Without its record (the first agent here, which
        writes one at once), what the files hold predates any agent that keeps one and counts as
        forwarded."""
        saved = read_model(self._state_path, Shipped)
        self.shipped = saved or Shipped(offsets={p.name: p.stat().st_size for p in self._files()})
        if saved is None:
            self._save()
        self._read_offsets = dict(self.shipped.offsets)
        self._thread.start()

    def _files(self) -> list[Path]:
        """The agent's own file first: its process events precede what the ranks it starts write."""
        return sorted(self.events_dir.glob(GroupLayout(self.group).events_glob), key=lambda p: p != self._own_path)

    def emit_process(self, action: str, **fields) -> ProcessEvent:
        """The agent's own event, appended to its file like a rank's, so it survives the agent."""
        event = ProcessEvent(ts=time.time(), group=self.group, eid=self._ids.next(), action=action, **fields)
        with self._write_lock:
            self.events_dir.mkdir(parents=True, exist_ok=True)
            with open(self._own_path, "a") as out:
                out.write(event.model_dump_json() + "\n")
        return event

    # --- reading
    def _read_new(self) -> None:
        for path in self._files():
            offset = self._read_offsets.get(path.name, 0)
            try:
                size = path.stat().st_size
                if size < offset:  # the file was replaced: read it from the start
                    offset = self.shipped.offsets[path.name] = 0
                if size == offset:
                    continue
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(size - offset)
            except OSError:
                continue
            for line in data[: data.rfind(b"\n") + 1].splitlines(keepends=True):  # a line being written waits
                offset += len(line)
                self._take(line, path.name, offset)
            self._read_offsets[path.name] = offset

    def _take(self, line: bytes, file: str, end: int) -> None:
        try:
            event = parse_event(line)
        except ValidationError as err:
            self.invalid += 1
            log.warning("skipping a line of %s that is no event: %s", file, err.errors()[0]["msg"])
            return
        if isinstance(event, StepEvent) and speaks_for_group(event) and event.committed:
            self.last_step = event.step
            self.on_step(event)
        if len(self.buffer) >= self.capacity:
            self._settle(self.buffer.popleft())
            self.shipped.dropped += 1
        self.buffer.append(_Read(event, file, end))

    def _settle(self, read: _Read) -> None:
        """The event has left for good (shipped, dropped or refused): its file's offset moves past it."""
        self.shipped.offsets[read.file] = max(self.shipped.offsets.get(read.file, 0), read.end)

    # --- shipping
    def _ship(self) -> None:
        if not self.control_plane:
            while self.buffer:
                self._settle(self.buffer.popleft())
            return
        size = self.batch
        while self.buffer and time.monotonic() >= self._retry_at:
            chunk = [self.buffer[i] for i in range(min(size, len(self.buffer)))]
            status, why = self._post(chunk)
            if status is None or status >= 500:
                self._back_off(why)
                return
            self._retry_at, self._backoff_s = 0.0, self.interval_s
            if not self.reachable:
                log.info("control plane reachable; shipping events")
            self.reachable = True
            if status == 413 and len(chunk) > 1:
                size = len(chunk) // 2
                continue
            for _ in chunk:
                self._settle(self.buffer.popleft())
            if status < 300:
                self.forwarded += len(chunk)
            else:
                self.shipped.refused += len(chunk)
                if why != self._last_refusal:
                    log.warning("the control plane refused %d event(s) (%d %s); dropped them", len(chunk), status, why)
                    self._last_refusal = why
            self._save()

    def _post(self, chunk: list[_Read]) -> tuple[int | None, str]:
        """The answer's status and what it said; None when there was no usable answer."""
        batch = IngestBatch(events=[r.event.model_dump(mode="json") for r in chunk],
                            dropped=self.shipped.dropped + self.shipped.refused)
        status, why, result = self._channel.send(batch)
        if result is not None:
            self._paced_s = result.send_every_s or 0.0
            if not result.agent_registered and self.registrar is not None:
                self.registrar.forget()
        return status, why

    def _back_off(self, why: str) -> None:
        if self.reachable:
            log.warning("control plane unreachable (%s); keeping events, asking again in %.1f s", why, self._backoff_s)
        self.reachable = False
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)

    def _save(self) -> None:
        try:
            write_model(self._state_path, self.shipped)
        except OSError as err:
            log.warning("cannot record what was shipped in %s: %s", self._state_path, err)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.registrar is not None:
                self.registrar.tick(self._client)
            self._read_new()
            self._ship()
            self._stop.wait(max(self.interval_s, self._paced_s))
        self._read_new()
        self._retry_at = 0.0
        self._ship()
        self._save()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT_S)
        if self._channel is not None:
            self._channel.close()
        self._client.close()
