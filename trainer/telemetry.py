"""Per-rank event stream that never blocks or fails a training step.

``emit`` puts the event on a bounded queue (about a microsecond); a daemon thread serialises
and appends it to this rank's JSON-lines file. When the queue is full the event is dropped
and counted; when the file cannot be written the writer keeps counting drops and training
goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from protocol.events import TorchftLogEvent, BaseEvent, events_file_name

_STOP = object()
TORCHFT_LOGGERS = ("torchft_quorums", "torchft_commits", "torchft_errors")
QUEUE_CAPACITY = 10_000
"""Events waiting for the writer thread: minutes of steps; only a stuck disk fills it."""
CLOSE_TIMEOUT_S = 5.0
"""At exit, the writer gets this long to flush what is queued."""


class EventSink:
    def __init__(self, events_dir: Path, group: int, rank: int, capacity: int = QUEUE_CAPACITY):
        self.group = group
        self.rank = rank
        self.path = events_dir / events_file_name(group, rank)
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._write_loop, name="ft-events", daemon=True)
        self._thread.start()

    def emit(self, event_cls: type[BaseEvent], **fields) -> None:
        try:
            self._queue.put_nowait((event_cls, time.time(), fields))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Flush what is queued and stop the writer."""
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def _write_loop(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.path, "a", buffering=1 << 16)
        except OSError:
            out = None
        while True:
            item = self._queue.get()
            batch = [item]
            while not self._queue.empty() and batch[-1] is not _STOP:
                batch.append(self._queue.get_nowait())
            lines = []
            for entry in batch:
                if entry is _STOP:
                    continue
                event_cls, ts, fields = entry
                try:
                    lines.append(event_cls(ts=ts, group=self.group, rank=self.rank, **fields).model_dump_json())
                except ValueError:
                    self.dropped += 1
            if out is None:
                self.dropped += len(lines)
            else:
                try:
                    out.write("".join(line + "\n" for line in lines))
                    out.flush()
                except OSError:
                    self.dropped += len(lines)
            if batch[-1] is _STOP:
                if out is not None:
                    out.close()
                return


class TorchftLogBridge(logging.Handler):
    """Forwards torchft's structured loggers (fields in the record's ``extra``) to the sink."""

    def __init__(self, sink: EventSink):
        super().__init__(level=logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        fields = {
            name: getattr(record, name)
            for name in ("quorum_id", "step", "commit_result", "replica_id", "error")
            if getattr(record, name, None) is not None
        }
        if "error" in fields:
            fields["error"] = str(fields["error"])
        self.sink.emit(TorchftLogEvent, logger=record.name, **fields)

    def install(self) -> None:
        for name in TORCHFT_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(logging.INFO)
            logger.addHandler(self)
