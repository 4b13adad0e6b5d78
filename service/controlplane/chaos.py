"""The chaos drill: random kills at exponential intervals, rejoins after a delay, goodput.

Goodput here is measured, not modelled: samples trained by committed steps per second
(``throughput.py``) during the chaos window against the failure-free rate measured just before
it in the same run, once no
warm spare is still building (a build takes CPU from the training beside it). Each kill is a
:class:`~service.controlplane.timeline.FaultTimeline`; the time lost is split per kill into
detection (kill → a survivor's quorum changed), restart (rejoin → the group's ranks are up),
heal (ranks up → its first committed step), rollback (survivor steps that did not commit, at
the median step time) and the wait before the rejoin: the drill's delay, or less when the
agents restart killed groups themselves (``ftctl up --auto-rejoin-delay``; with a warm spare
that is a fail-over within a step or two).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from protocol.events import Event, StepEvent, speaks_for_group
from service.controlplane.bus import StoredEvent
from service.controlplane.drill_context import DrillContext
from service.controlplane.errors import DrillFailed
from service.controlplane.models import ChaosKill, ChaosReport
from service.controlplane.throughput import ThroughputMeter
from service.controlplane.timeline import FaultTimeline, Milestone

TICK_S = 0.1
"""How often the chaos loop looks whether a kill or a rejoin is due."""
CATCH_UP_S = 2.0
"""Before the baseline: time for the event stream to reach the current step."""
SPARES_POLL_S = 1.0


def chaos_kill(t: FaultTimeline) -> ChaosKill:
    return ChaosKill(group=t.group, killed_at=t.fault_at, rejoined_at=t.rejoined_at, detected_at=t.detected_at,
                     started_at=t.up_at, healed_commit_at=t.healed_commit_at,
                     survivor_steps_lost=t.survivor_steps_lost, detect_s=t.detect_s, restart_s=t.restart_s,
                     heal_s=t.heal_s)


class ChaosRun:
    """Runs one chaos drill against the live job; the runner persists ``report`` as it goes."""

    def __init__(self, ctx: DrillContext, report: ChaosReport):
        self.ctx = ctx
        self.control = ctx.control
        self.r = report
        self.meter = ThroughputMeter()
        self.step_times: dict[str, list[float]] = {}  # by phase: baseline, chaos, settling
        self.timelines: list[FaultTimeline] = []
        self.open: dict[int, FaultTimeline] = {}

    def save(self) -> None:
        self.r.kills = [chaos_kill(t) for t in self.timelines]
        self.ctx.save()

    def _observe(self, e: Event) -> None:
        if isinstance(e, StepEvent) and speaks_for_group(e) and e.committed:
            self.meter.observe(e)
            self.step_times.setdefault(self.r.phase, []).append(e.step_s)
        for t in self.open.values():
            t.observe(e)
        for g in [g for g, t in self.open.items() if t.reached(Milestone.HEALED) and t.reached(Milestone.REJOINED)]:
            del self.open[g]

    async def _consume(self, queue: asyncio.Queue[StoredEvent]) -> None:
        while True:
            self._observe((await queue.get()).event)

    async def run(self) -> None:
        queue = self.ctx.bus.subscribe()
        consumer = asyncio.create_task(self._consume(queue))
        try:
            await self._baseline()
            await self._chaos()
            await self._settle()
        finally:
            consumer.cancel()
            self.ctx.bus.unsubscribe(queue)

    async def _rate_over(self, seconds: float) -> float:
        start_samples, start = self.meter.samples, time.time()
        await asyncio.sleep(seconds)
        return (self.meter.samples - start_samples) / (time.time() - start)

    async def _wait_for_spares(self) -> None:
        """A warm spare still building takes CPU from the training beside it: the failure-free
        rate is measured once none is."""
        self.r.phase = "spares"
        self.save()
        timeout_s = self.ctx.settings.spares_timeout_s
        deadline = time.time() + timeout_s
        while building := [g for g in sorted(self.control.board.views)
                           if (await self.ctx.agents.status(g)).spare == "starting"]:
            if time.time() > deadline:
                raise DrillFailed(f"the warm spare of group {building[0]} is not ready after "
                                  f"{timeout_s:.0f}s; see that agent's log")
            await asyncio.sleep(SPARES_POLL_S)

    async def _baseline(self) -> None:
        await self._wait_for_spares()
        self.r.phase = "baseline"
        self.save()
        await asyncio.sleep(CATCH_UP_S)
        self.r.baseline_rate = await self._rate_over(self.r.baseline_s)
        self.save()

    async def _kill(self, victim: int) -> FaultTimeline:
        # begun before the command: the survivors' reaction can arrive while it runs
        t = FaultTimeline.begin(victim, time.time(), self.control.board.views, self.ctx.settings.ranks_per_group)
        self.open[victim] = t
        self.timelines.append(t)
        await self.control.kill(victim, at=t.fault_at, drill_id=self.ctx.drill_id)
        self.save()
        return t

    async def _chaos(self) -> None:
        self.r.phase = "chaos"
        rng = random.Random(self.r.seed)
        start_samples, start = self.meter.samples, time.time()
        end = start + self.r.duration_s
        next_kill = start + rng.expovariate(1.0 / self.r.mtbf_s)
        rejoins: list[tuple[float, FaultTimeline]] = []
        while (now := time.time()) < end:
            for due in [x for x in rejoins if x[0] <= now]:
                rejoins.remove(due)
                await self._rejoin(due[1])
            if now >= next_kill:
                views = self.control.board.views
                alive = [g for g, v in views.items() if v.state == "training" and g not in self.open]
                if len(alive) >= 2:  # never kill the last training group: that is a restart, not chaos
                    t = await self._kill(rng.choice(alive))
                    rejoins.append((t.fault_at + self.r.rejoin_delay_s, t))
                next_kill = now + rng.expovariate(1.0 / self.r.mtbf_s)
            await asyncio.sleep(TICK_S)
        self.r.chaos_rate = (self.meter.samples - start_samples) / (time.time() - start)
        self.r.goodput = self.r.chaos_rate / self.r.baseline_rate if self.r.baseline_rate else None
        for _, t in rejoins:  # groups still down at the end come back too
            await self._rejoin(t)

    async def _rejoin(self, t: FaultTimeline) -> None:
        """Rejoin a killed group, unless its agent has restarted it already (its process event
        then tells when)."""
        if not t.reached(Milestone.REJOINED):
            rejoin = await self.control.bring_back(t.group, self.ctx.drill_id)
            if not rejoin.restarted_by_agent:
                t.rejoined(rejoin.at, "drill")

    async def _settle(self) -> None:
        """Wait for the last heals, then add up the time lost per term."""
        self.r.phase = "settling"
        self.save()
        deadline = time.time() + self.ctx.settings.settle_timeout_s
        while self.open and time.time() < deadline:
            await asyncio.sleep(TICK_S)
        every = [s for times in self.step_times.values() for s in times]
        step_s = statistics.median(every) if every else 0.0
        self.r.median_step_s = step_s
        self.r.baseline_step_s, self.r.chaos_step_s = (
            statistics.median(self.step_times[phase]) if self.step_times.get(phase) else None
            for phase in ("baseline", "chaos"))
        healed = [t for t in self.timelines if t.heal_s is not None]

        def total(values) -> float:
            return sum(v for v in values if v is not None)

        self.r.lost_s = {
            "detect": total(t.detect_s for t in healed),
            "restart": total(t.restart_s for t in healed),
            "heal": total(t.heal_s for t in healed),
            "rollback": sum(t.survivor_steps_lost for t in self.timelines) * step_s,
            "waiting_to_rejoin": total(t.rejoined_at - t.fault_at for t in healed),
        }
        self.save()
