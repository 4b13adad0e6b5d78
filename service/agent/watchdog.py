"""The agent's hang watchdog: it ends its group when a rank stops making progress.

A hang is the failure nothing reports (the seed's chapter 3): the other groups wait in their
all-reduce until its timeout. Every rank keeps a progress beacon (``protocol/beacon.py``); the
watchdog reads its group's beacons every ``interval_s`` and declares the group hung when a rank
of its current processes

- has a beacon older than ``silence_s``: the process is stopped, or its interpreter wedged;
- has spent longer than the step bound in a phase it works on alone (compute, commit); the
  bound adapts to the job, as Megatron's calculated section timeouts do:
  ``max(floor_s, factor × the median of the group's recent step times)``, and applies once
  ``min_steps`` steps of this start are known. The time a rank was runnable but waiting for a
  CPU (its beacon's ``starved_s``) does not count: a machine busy with other work makes a rank
  slow, not stuck, and ending it would cost a restart and a heal for nothing;
- has spent longer than ``checkpoint_s`` saving a checkpoint.

Waiting on other groups (``allreduce``) and starting are never judged (a warm spare writes no
beacon until promoted):
a slow peer, a heal, a quorum or a promotion is not this group's hang. The decision is
:func:`hang_verdict`, a pure function of the time, the beacons and the step times.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from protocol.layout import GroupLayout
from protocol.beacon import JUDGED_PHASES, Beacon, read_beacon

log = logging.getLogger("agent.watchdog")


@dataclass(frozen=True)
class WatchdogSettings:
    interval_s: float
    silence_s: float
    floor_s: float
    factor: float
    min_steps: int
    checkpoint_s: float


def step_bound(s: WatchdogSettings, step_times: Sequence[float]) -> float | None:
    """How long a rank may stay in a judged phase; None while too few steps are known."""
    if len(step_times) < s.min_steps:
        return None
    return max(s.floor_s, s.factor * statistics.median(step_times))


def hang_verdict(now: float, beacons: Mapping[int, Beacon | None], pids: set[int], step_times: Sequence[float],
                 s: WatchdogSettings) -> str | None:
    """Why the group is hung, in one line, or None. Beacons of other processes (an earlier
    start, a warm spare) and ranks without one yet are not judged.

    A silent beacon names its rank. A rank stuck inside its step does not stand out by its
    phase: its group's other ranks wait for it in FSDP's in-group collectives, in the same phase
    of the same step, and whichever of them crosses the bound first is chance. So the group is
    hung when every rank working on the step of the one longest in its phase is over the bound,
    and the verdict names them all: the group is what it attributes. A rank waiting for a CPU
    keeps its peers blocked in those collectives, and its own time under the bound (the wait is
    not counted) keeps the group from being called hung."""
    bound = step_bound(s, step_times)
    working: list[tuple[int, Beacon, float]] = []  # (rank, beacon, seconds in phase not waiting for a CPU)
    for rank, b in sorted(beacons.items()):
        if b is None or b.pid not in pids or b.phase == "starting":
            continue
        silent = now - b.ts
        if silent > s.silence_s:
            return f"rank {rank} silent for {silent:.1f} s (bound {s.silence_s:g} s): stopped or wedged in {b.phase}"
        in_phase = now - b.since
        if b.phase == "checkpoint" and in_phase > s.checkpoint_s:
            return f"rank {rank} saving a checkpoint for {in_phase:.1f} s (bound {s.checkpoint_s:g} s)"
        if b.phase in JUDGED_PHASES:
            working.append((rank, b, in_phase - min(b.starved_s, in_phase)))
    if bound is None or not working:
        return None
    _, b, _ = max(working, key=lambda o: o[2])
    stalled = [(rank, other, t) for rank, other, t in working if other.step == b.step]
    if min(t for _, _, t in stalled) <= bound:
        return None
    starved = max(other.starved_s for _, other, _ in stalled)
    ranks = ", ".join(str(rank) for rank, _, _ in stalled)
    return (f"rank{'s' if len(stalled) > 1 else ''} {ranks} in {b.phase} at step {b.step} for {now - b.since:.1f} s"
            + (f" ({starved:.1f} s of it waiting for a CPU, not counted)" if starved >= 0.05 else "")
            + f" (bound {bound:.1f} s: {s.factor:g} × median step {statistics.median(step_times):.2f} s, "
            f"floor {s.floor_s:g} s)")


class Watchdog:
    """Runs :func:`hang_verdict` over the group's beacons and hands a verdict to ``on_hung``."""

    def __init__(self, settings: WatchdogSettings, events_dir: Path, group: int, ranks_per_group: int,
                 owns: Callable[[int], bool], on_hung: Callable[[str], None], step_window: int = 20):
        self.settings = settings
        self.paths = {r: events_dir / GroupLayout(group).beacon(r) for r in range(ranks_per_group)}
        self.owns = owns
        self.on_hung = on_hung
        self.step_times: deque[float] = deque(maxlen=step_window)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    def started(self) -> None:
        """The group was (re)started: its step times begin again."""
        with self._lock:
            self.step_times.clear()

    def stepped(self, step_s: float) -> None:
        with self._lock:
            self.step_times.append(step_s)

    def check(self) -> str | None:
        beacons = {r: read_beacon(p) for r, p in self.paths.items()}
        pids = {b.pid for b in beacons.values() if b is not None and self.owns(b.pid)}
        if not pids:
            return None
        with self._lock:
            steps = list(self.step_times)
        return hang_verdict(time.time(), beacons, pids, steps, self.settings)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            verdict = self.check()
            if verdict is not None:
                log.warning("group hung: %s", verdict)
                self.on_hung(verdict)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.settings.interval_s * 10)
