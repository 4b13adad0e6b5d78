"""The straggler drill (the seed's slow_rank): slow one live group down and watch the detector.

Phases: ``baseline`` (the job's committed throughput before), ``injected`` (every rank of the
group sleeps ``delay_ms`` before each forward for ``duration_s``, told through its agent, with
no restart; the detector in ``stragglers.py`` should flag it, and the straggler policy act),
``after`` (the throughput once the delay is over). Throughput is trained samples per
second (``throughput.py``), as the chaos drill counts it: with ``--batch-policy constant`` an
evicted group's share goes to the others, and the throughput says what that costs them.
The drill may run under another straggler policy than the job's (``policy``), to see what
eviction would do; the job's comes back when it ends.
"""

from __future__ import annotations

import asyncio
import time

from protocol.events import Event, ProcessEvent, StepEvent, StragglerEvent, speaks_for_group
from protocol.injection import InjectRequest
from service.controlplane.bus import StoredEvent
from service.controlplane.drill_context import DrillContext
from service.controlplane.models import StragglerReport
from service.controlplane.stragglers import StragglerTracker
from service.controlplane.throughput import ThroughputMeter

TICK_S = 0.2
CATCH_UP_S = 2.0
"""After a phase: time for its last step events to reach the control plane."""


class StragglerRun:
    """Runs one straggler drill against the live job; the runner persists ``report`` as it goes."""

    def __init__(self, ctx: DrillContext, report: StragglerReport, tracker: StragglerTracker):
        self.ctx = ctx
        self.r = report
        self.tracker = tracker
        self.meter = ThroughputMeter()

    def _observe(self, e: Event) -> None:
        r = self.r
        match e:
            case StepEvent(committed=True) if speaks_for_group(e):
                self.meter.observe(e)
            case StragglerEvent(action="flagged") if r.injected_at is not None and e.ts >= r.injected_at:
                if r.detected_group is None:
                    r.detected_group, r.detected_at, r.detect_s = e.group, e.ts, e.ts - r.injected_at
                    r.relative, r.individual, r.slowdown = e.relative, e.individual, e.slowdown
                    r.slowest_share, r.keep_cost, r.evict_cost = e.slowest_share, e.keep_cost, e.evict_cost
                    r.action, r.detail = "flagged", e.detail
                if e.group != r.group and e.group not in r.others_flagged:
                    r.others_flagged.append(e.group)
            case StragglerEvent(action="cleared") if e.group == r.detected_group and r.cleared_at is None:
                r.cleared_at = e.ts
            case ProcessEvent(action="evicted") if e.group == r.group:
                r.action, r.evicted_at = "evicted", e.ts
            case ProcessEvent(action=reason) if e.group == r.group and reason != "started" and r.ended is None:
                r.ended = f"{reason}: {e.detail}" if e.detail else reason

    async def _consume(self, queue: asyncio.Queue[StoredEvent]) -> None:
        while True:
            self._observe((await queue.get()).event)

    async def _phase(self, name: str, seconds: float) -> None:
        self.r.phase = name
        self.ctx.save()
        end = time.time() + seconds
        while time.time() < end:
            await asyncio.sleep(TICK_S)

    async def run(self) -> None:
        queue = self.ctx.bus.subscribe()
        consumer = asyncio.create_task(self._consume(queue))
        r = self.r
        policy, self.tracker.policy = self.tracker.policy, r.policy
        try:
            started = time.time()
            await self._phase("baseline", r.baseline_s)
            injected = await self.ctx.control.inject(
                r.group, InjectRequest(kind="slow", delay_ms=r.delay_ms, seconds=r.duration_s), self.ctx.drill_id)
            r.injected_at, r.flagged_before = injected.at, self.tracker.flagged
            await self._phase("injected", r.duration_s)
            ended = injected.at + r.duration_s
            await self._phase("after", r.after_s + CATCH_UP_S)
            spans = {"before": (started, injected.at), "during": (injected.at, ended),
                     "after": (ended, ended + r.after_s)}
            r.throughput = {k: self.meter.rate(*span) for k, span in spans.items()}
            r.median_step_s = {k: self.meter.median_step_s(*span) for k, span in spans.items()}
            if r.detected_group is None:
                r.action = "none"
        finally:
            self.tracker.policy = policy
            consumer.cancel()
            self.ctx.bus.unsubscribe(queue)
