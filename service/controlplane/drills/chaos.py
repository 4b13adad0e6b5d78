"""The chaos drill: random kills at exponential intervals, rejoins after a delay, goodput.

Goodput here is measured, not modelled: samples trained by committed steps per second
(``throughput.py``) during the chaos window against the failure-free rate measured just before
it in the same run, once no
warm spare is still building (a build takes CPU from the training beside it). Each kill is a
:class:`~service.controlplane.timeline.FaultTimeline`; the time lost is split per kill into
detection (kill → a survivor's quorum changed), restart (rejoin → the group's ranks are up),
heal (ranks up → its first committed step), rollback (survivor steps that did not commit, at
the median step time) and the wait before the rejoin: the drill's delay, or less when the
agents restart killed groups themselves (``ftctl up``'s default; with a warm spare
that is a fail-over within a step or two).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Literal

from pydantic import BaseModel, Field

from protocol.events import JSON_INT_MAX, Event, StepEvent, speaks_for_group
from service.controlplane.drills.base import Drill, DrillBody, Prepared
from service.controlplane.drills.context import DrillServices
from service.controlplane.drills.rows import Row
from service.controlplane.drills.timeline import FaultTimeline, Milestone
from service.controlplane.errors import DrillConflict, DrillFailed
from service.controlplane.throughput import ThroughputMeter

TICK_S = 0.1
"""How often the chaos loop looks whether a kill or a rejoin is due."""
CATCH_UP_S = 2.0
"""Before the baseline: time for the event stream to reach the current step."""
SPARES_POLL_S = 1.0


class ChaosIn(DrillBody):
    """Kill random groups at exponentially distributed intervals; measure goodput."""

    kind: Literal["chaos"]
    mtbf_s: float = Field(gt=0, le=86_400, description="mean seconds between kills")
    duration_s: float = Field(gt=0, le=86_400, description="length of the chaos window")
    seed: int = Field(0, ge=0, le=JSON_INT_MAX, description="random seed (same seed, same kills)")
    rejoin_delay_s: float = Field(5.0, ge=0, le=3600, description="a killed group is rejoined after this")
    baseline_s: float = Field(20.0, gt=0, le=3600, description="failure-free measurement before the chaos")


class ChaosKill(BaseModel):
    group: int
    killed_at: float
    rejoined_at: float | None = None
    detected_at: float | None = None
    started_at: float | None = Field(None, description="the group's ranks were up again (its start event)")
    healed_commit_at: float | None = None
    survivor_steps_lost: int = 0
    detect_s: float | None = None
    restart_s: float | None = None
    heal_s: float | None = None


class ChaosReport(BaseModel):
    mtbf_s: float
    duration_s: float
    seed: int
    rejoin_delay_s: float
    baseline_s: float
    phase: str = "starting"
    baseline_rate: float | None = Field(None, description="samples trained by committed steps per second, "
                                        "failure-free (× the sequence length: tokens)")
    chaos_rate: float | None = Field(None, description="samples trained by committed steps per second under chaos")
    goodput: float | None = Field(None, description="chaos_rate / baseline_rate")
    median_step_s: float | None = None
    baseline_step_s: float | None = Field(None, description="median step time, failure-free")
    chaos_step_s: float | None = Field(
        None, description="median step time under chaos: above baseline_step_s when restarts and spare rebuilds "
        "share the CPU (or network) with training, a loss none of lost_s's terms holds")
    kills: list[ChaosKill] = []
    lost_s: dict[str, float] = Field(default_factory=dict, description="time lost per term, summed over kills")


def chaos_kill(t: FaultTimeline) -> ChaosKill:
    return ChaosKill(group=t.group, killed_at=t.fault_at, rejoined_at=t.rejoined_at, detected_at=t.detected_at,
                     started_at=t.up_at, healed_commit_at=t.healed_commit_at,
                     survivor_steps_lost=t.survivor_steps_lost, detect_s=t.detect_s, restart_s=t.restart_s,
                     heal_s=t.heal_s)


class Chaos(Drill):
    """Runs one chaos drill against the live job; the runner persists ``report`` as it goes."""

    kind = "chaos"
    Request = ChaosIn
    Report = ChaosReport
    summary = "kill random groups at exponential intervals, rejoin them, measure goodput"

    @classmethod
    def prepare(cls, request: ChaosIn, services: DrillServices) -> Prepared:
        training = services.control.board.training()
        if len(training) < 2:
            raise DrillConflict(f"chaos needs at least 2 groups training, {len(training)} are")
        return Prepared(group=None, report=ChaosReport(**request.model_dump(exclude={"kind"})))

    @classmethod
    def title(cls, drill: dict) -> str:
        r = drill["report"]
        return f"chaos · mtbf {r['mtbf_s']:g}s · {r['duration_s']:g}s · seed {r['seed']}"

    @classmethod
    def rows(cls, r: dict) -> list[Row]:
        def rate(v: float | None) -> str:
            return f"{v:.2f} samples/s" if v is not None else "-"

        base, chaos = r.get("baseline_step_s"), r.get("chaos_step_s")
        return [
            ("failure-free rate", rate(r.get("baseline_rate"))),
            ("rate under chaos", rate(r.get("chaos_rate"))),
            ("goodput", f"{100 * r['goodput']:.1f}%" if r.get("goodput") is not None else "-"),
            ("kills", ", ".join(f"g{k['group']}" for k in r.get("kills", [])) or "none"),
            *([("median step", f"{base:.2f} s failure-free, {chaos:.2f} s under chaos ({chaos / base:.2f}×)")]
              if base and chaos else []),
            *((f"lost to {term.replace('_', ' ')}", f"{seconds:.1f} s")
              for term, seconds in (r.get("lost_s") or {}).items()),
        ]

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.control = self.ctx.control
        self.meter = ThroughputMeter()
        self.step_times: dict[str, list[float]] = {}  # by phase: baseline, chaos, settling
        self.timelines: list[FaultTimeline] = []
        self.open: dict[int, FaultTimeline] = {}

    def save(self) -> None:
        self.r.kills = [chaos_kill(t) for t in self.timelines]
        self.ctx.save()

    def observe(self, e: Event) -> None:
        if isinstance(e, StepEvent) and speaks_for_group(e) and e.committed:
            self.meter.observe(e)
            self.step_times.setdefault(self.r.phase, []).append(e.step_s)
        for t in self.open.values():
            t.observe(e)
        for g in [g for g, t in self.open.items() if t.reached(Milestone.HEALED) and t.reached(Milestone.REJOINED)]:
            del self.open[g]

    async def run(self) -> None:
        async with self.observing():
            await self._baseline()
            await self._chaos()
            await self._settle()

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
        await self.control.kill(victim, drill_id=self.ctx.drill_id)
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
                alive = [g for g in self.control.board.training() if g not in self.open]
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
