"""Per-rank telemetry that never blocks or fails a training step: events, and the progress beacon.

``emit`` puts the event on a bounded queue (about a microsecond); a daemon thread serialises
and appends it to this rank's JSON-lines file. When the queue is full the event is dropped
and counted; when the file cannot be written the writer keeps counting drops and training
goes on.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

from protocol.layout import GroupLayout
from protocol.beacon import BEACON_INTERVAL_S, Beacon, Phase
from protocol.events import BaseEvent, EventIds, TorchftLogEvent
from protocol.files import write_model

_STOP = object()
log = logging.getLogger("trainer.events")
TORCHFT_LOGGERS = ("torchft_quorums", "torchft_commits", "torchft_errors")
QUEUE_CAPACITY = 10_000
"""Events waiting for the writer thread: minutes of steps; only a stuck disk fills it."""
CLOSE_TIMEOUT_S = 5.0
"""At exit, the writer gets this long to flush what is queued."""


class EventSink:
    def __init__(self, events_dir: Path, group: int, rank: int, capacity: int = QUEUE_CAPACITY):
        self.group = group
        self.rank = rank
        self.path = events_dir / GroupLayout(group).rank_events(rank)
        self.ids = EventIds(GroupLayout(group).event_ids(rank))
        self.dropped = 0
        self._invalid: set[type[BaseEvent]] = set()
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
                    lines.append(event_cls(ts=ts, group=self.group, rank=self.rank, eid=self.ids.next(),
                                           **fields).model_dump_json())
                except ValueError as err:
                    self.dropped += 1
                    self._said_invalid(event_cls, err)
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


    def _said_invalid(self, event_cls: type[BaseEvent], err: ValueError) -> None:
        """An event this trainer made that its own schema refuses is a bug: said once per kind
        (the rest are counted in ``dropped``, which the exit event carries)."""
        if event_cls not in self._invalid:
            self._invalid.add(event_cls)
            log.warning("dropped a %s event its schema refuses (further ones are only counted): %s",
                        event_cls.__name__, str(err).replace("\n", "; "))


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


SCHEDSTAT = Path("/proc/self/schedstat")
"""The main thread's scheduler counters (run ns, run-queue wait ns, timeslices): the training loop
runs there; the file names the thread-group leader whichever thread reads it."""


def run_queue_wait_s() -> float:
    """How long this process's main thread has been runnable but waiting for a CPU, in all; 0.0
    where the kernel keeps no schedstat."""
    try:
        return int(SCHEDSTAT.read_bytes().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class ProgressBeacon:
    """This rank's phase for its agent's hang watchdog (``protocol/beacon.py``).

    The training loop calls :meth:`enter` at each phase change (a read of its run-queue wait, a
    few microseconds, and one attribute write); a daemon thread rewrites the beacon file every
    ``BEACON_INTERVAL_S``, with the wait for a CPU since the phase began. A stopped process stops
    the thread too, and a rank stuck inside its step keeps reporting the phase it is stuck in.
    """

    def __init__(self, events_dir: Path, group: int, rank: int):
        self.path = events_dir / GroupLayout(group).beacon(rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # (phase, since, step, run-queue wait at since): replaced whole, no torn reads
        self._state: tuple[Phase, float, int, float] = ("starting", time.time(), 0, run_queue_wait_s())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ft-beacon", daemon=True)
        self._thread.start()

    def enter(self, phase: Phase, step: int | None = None) -> None:
        self._state = (phase, time.time(), self._state[2] if step is None else step, run_queue_wait_s())

    def _beat(self) -> None:
        pid = os.getpid()
        while True:
            phase, since, step, waited_at_since = self._state
            now = time.time()
            starved = min(max(0.0, run_queue_wait_s() - waited_at_since), max(0.0, now - since))
            try:
                write_model(self.path, Beacon(pid=pid, phase=phase, since=since, step=step, ts=now, starved_s=starved))
            except OSError:
                pass  # a full or missing disk must not stop training; the watchdog then sees silence
            if self._stop.wait(BEACON_INTERVAL_S):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(BEACON_INTERVAL_S * 10)
        self.path.unlink(missing_ok=True)
