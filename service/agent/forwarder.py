"""Tails the group's per-rank event files and ships them to the control plane in batches.

Training never waits for this: the trainer appends to files, this thread reads them. While
the control plane is away events stay in a bounded buffer; the oldest are dropped (and
counted) when it is full. Each batch is an ``IngestBatch`` posted to ``INGEST_PATH``
(``protocol/ingest.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import httpx
from pydantic import ValidationError

from protocol.events import Event, ProcessEvent, StepEvent, events_file_glob, parse_event, speaks_for_group
from protocol.ingest import INGEST_PATH, IngestBatch, IngestResult

log = logging.getLogger("agent.forwarder")
JOIN_TIMEOUT_S = 10.0
"""At shutdown, the last read and ship of what the group wrote may take this long; what is
still buffered after it is lost with the agent."""


class EventForwarder:
    def __init__(self, group: int, events_dir: Path, control_plane: str | None, token: str,
                 capacity: int, interval_s: float, batch: int, timeout_s: float,
                 on_step: Callable[[StepEvent], None] = lambda step: None):
        """``on_step`` hears every committed step the group's rank 0 writes."""
        self.group = group
        self.on_step = on_step
        self.events_dir = events_dir
        self.control_plane = control_plane
        self.interval_s = interval_s
        self.batch = batch
        self.buffer: deque[Event] = deque()
        self.capacity = capacity
        self.dropped = 0
        self.forwarded = 0
        self.last_step: int | None = None
        self.reachable = False
        self._offsets: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {token}"})
        self._thread = threading.Thread(target=self._run, name="event-forwarder", daemon=True)

    def start(self) -> None:
        """Begin at the current end of existing files: earlier runs were forwarded by earlier agents."""
        for path in self._files():
            self._offsets[path] = path.stat().st_size
        self._thread.start()

    def _files(self) -> list[Path]:
        return sorted(self.events_dir.glob(events_file_glob(self.group)))

    def push(self, event: Event) -> None:
        with self._lock:
            if len(self.buffer) >= self.capacity:
                self.buffer.popleft()
                self.dropped += 1
            self.buffer.append(event)

    def emit_process(self, action: str, **fields) -> None:
        self.push(ProcessEvent(ts=time.time(), group=self.group, action=action, **fields))

    def _read_new(self) -> None:
        for path in self._files():
            offset = self._offsets.get(path, 0)
            try:
                size = path.stat().st_size
                if size < offset:  # the file was replaced: read it from the start
                    offset = 0
                if size == offset:
                    continue
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(size - offset)
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
            self._offsets[path] = offset + len(complete)
            for line in complete.splitlines():
                try:
                    event = parse_event(line)
                except ValidationError as err:
                    log.warning("skipping a line of %s that is no event: %s", path.name, err.errors()[0]["msg"])
                    continue
                if isinstance(event, StepEvent) and speaks_for_group(event) and event.committed:
                    self.last_step = event.step
                    self.on_step(event)
                self.push(event)

    def _ship(self) -> None:
        if not self.control_plane:
            with self._lock:
                self.buffer.clear()
            return
        while True:
            with self._lock:
                chunk = [self.buffer.popleft() for _ in range(min(self.batch, len(self.buffer)))]
                dropped = self.dropped
            if not chunk:
                return
            batch = IngestBatch(group=self.group, events=[e.model_dump(mode="json") for e in chunk], dropped=dropped)
            try:
                response = self._client.post(f"{self.control_plane}{INGEST_PATH}", json=batch.model_dump(mode="json"))
                IngestResult.model_validate(response.raise_for_status().json())
            except (httpx.HTTPError, ValueError) as err:
                if self.reachable:
                    log.warning("control plane unreachable (%s); buffering events", err)
                self.reachable = False
                self._put_back(chunk)
                return
            self.reachable = True
            self.forwarded += len(chunk)

    def _put_back(self, chunk: list[Event]) -> None:
        """Return an unsent chunk to the front, oldest first out if that overfills the buffer."""
        with self._lock:
            self.buffer.extendleft(reversed(chunk))
            while len(self.buffer) > self.capacity:
                self.buffer.popleft()
                self.dropped += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read_new()
            self._ship()
            self._stop.wait(self.interval_s)
        self._read_new()
        self._ship()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT_S)
        self._client.close()
