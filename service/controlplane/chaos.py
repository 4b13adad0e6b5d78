"""The chaos drill: random kills at exponential intervals, rejoins after a delay, goodput.

Goodput here is measured, not modelled: committed replica-batches per second during the
chaos window against the failure-free rate measured just before it in the same run, once no
warm spare is still building (a build takes CPU from the training beside it). The time
lost is split per kill into detection (kill → a survivor's quorum changed), restart (rejoin
→ the group's ranks are up), heal (ranks up → first committed step after the heal),
rollback (survivor steps that did not commit, at the median step time) and the wait before
the rejoin: the drill's delay, or less when the agents restart killed groups themselves
(``ftctl up --auto-rejoin-delay``; with a warm spare that is a fail-over within a step or two).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Callable

from fastapi import HTTPException
from pydantic import BaseModel, Field

from service.controlplane import group_control
from service.controlplane.agents import AgentClient
from service.controlplane.hub import Hub


class ChaosKill(BaseModel):
    group: int
    killed_at: float
    rejoined_at: float | None = None
    detected_at: float | None = None
    started_at: float | None = None
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
    baseline_rate: float | None = Field(None, description="replica-batches committed per second, failure-free")
    chaos_rate: float | None = Field(None, description="replica-batches committed per second under chaos")
    goodput: float | None = Field(None, description="chaos_rate / baseline_rate")
    median_step_s: float | None = None
    baseline_step_s: float | None = Field(None, description="median step time, failure-free")
    chaos_step_s: float | None = Field(
        None, description="median step time under chaos: above baseline_step_s when restarts and spare rebuilds "
        "share the CPU (or network) with training, a loss none of lost_s's terms holds")
    kills: list[ChaosKill] = []
    lost_s: dict[str, float] = Field(default_factory=dict, description="time lost per term, summed over kills")


class ChaosRun:
    """Runs one chaos drill against the live job; the runner persists ``report`` as it goes."""

    def __init__(self, hub: Hub, agents: AgentClient, report: ChaosReport, save: Callable[[], None],
                 spares_timeout_s: float = 300.0):
        self.hub = hub
        self.agents = agents
        self.spares_timeout_s = spares_timeout_s
        self.r = report
        self.save = save
        self.batches = 0  # highest batches_committed any rank 0 reported
        self.step_times: dict[str, list[float]] = {}  # by phase: baseline, chaos, settling
        self.open: dict[int, ChaosKill] = {}

    def _observe(self, e: dict) -> None:
        if e["type"] == "process" and e["action"] == "started":
            kill = self.open.get(e["group"])
            if kill is not None and kill.rejoined_at is None and e["ts"] >= kill.killed_at:
                kill.rejoined_at = e["ts"]  # its agent restarted it by itself (--auto-rejoin-delay)
        if e.get("rank") != 0:
            return
        if e["type"] == "step" and e["committed"]:
            self.batches = max(self.batches, e["batches_committed"])
            self.step_times.setdefault(self.r.phase, []).append(e["step_s"])
        for kill in self.open.values():
            if e["group"] != kill.group:
                if e["type"] == "torchft" and e["logger"] == "torchft_quorums" and kill.detected_at is None \
                        and e["ts"] >= kill.killed_at:
                    kill.detected_at = e["ts"]
                elif e["type"] == "commit_failed" and e["ts"] >= kill.killed_at:
                    kill.survivor_steps_lost += 1
            elif e["ts"] >= kill.killed_at:  # its new processes: their events may overtake the agent's
                if e["type"] == "start" and kill.started_at is None:
                    kill.started_at = e["ts"]
                elif e["type"] == "step" and e["committed"] and kill.started_at is not None:
                    kill.healed_commit_at = e["ts"]
        for g in [g for g, k in self.open.items() if k.healed_commit_at is not None and k.rejoined_at is not None]:
            done = self.open.pop(g)
            done.detect_s = (done.detected_at or done.killed_at) - done.killed_at
            done.restart_s = done.started_at - done.rejoined_at
            done.heal_s = done.healed_commit_at - done.started_at

    async def _consume(self, queue: asyncio.Queue) -> None:
        while True:
            self._observe(await queue.get())

    async def run(self) -> None:
        queue = self.hub.subscribe()
        consumer = asyncio.create_task(self._consume(queue))
        try:
            await self._baseline()
            await self._chaos()
            await self._settle()
        finally:
            consumer.cancel()
            self.hub.unsubscribe(queue)

    async def _rate_over(self, seconds: float) -> float:
        start_batches, start = self.batches, time.time()
        await asyncio.sleep(seconds)
        return (self.batches - start_batches) / (time.time() - start)

    async def _wait_for_spares(self) -> None:
        """A warm spare still building takes CPU from the training beside it: the failure-free
        rate is measured once none is."""
        self.r.phase = "spares"
        self.save()
        deadline = time.time() + self.spares_timeout_s
        while building := [g for g in sorted(self.hub.views) if (await self.agents.status(g))["spare"] == "starting"]:
            if time.time() > deadline:
                raise HTTPException(409, f"the warm spare of group {building[0]} is not ready after "
                                         f"{self.spares_timeout_s:.0f}s; see that agent's log")
            await asyncio.sleep(1.0)

    async def _baseline(self) -> None:
        await self._wait_for_spares()
        self.r.phase = "baseline"
        self.save()
        await asyncio.sleep(2.0)  # let the consumer catch up with the current batch count
        self.r.baseline_rate = await self._rate_over(self.r.baseline_s)
        self.save()

    async def _chaos(self) -> None:
        self.r.phase = "chaos"
        rng = random.Random(self.r.seed)
        start_batches, start = self.batches, time.time()
        end = start + self.r.duration_s
        next_kill = start + rng.expovariate(1.0 / self.r.mtbf_s)
        rejoins: list[tuple[float, ChaosKill]] = []
        while (now := time.time()) < end:
            for when, kill in [x for x in rejoins if x[0] <= now]:
                rejoins.remove((when, kill))
                await self._rejoin(kill)
            if now >= next_kill:
                alive = [g for g, v in self.hub.views.items() if v.state == "training" and g not in self.open]
                if len(alive) >= 2:  # never kill the last training group: that is a restart, not chaos
                    victim = rng.choice(alive)
                    # registered before the command: the survivors' reaction can arrive while it runs
                    kill = ChaosKill(group=victim, killed_at=time.time())
                    self.open[victim] = kill
                    await group_control.kill(self.agents, self.hub, victim, kill.killed_at)
                    self.r.kills.append(kill)
                    rejoins.append((kill.killed_at + self.r.rejoin_delay_s, kill))
                    self.save()
                next_kill = now + rng.expovariate(1.0 / self.r.mtbf_s)
            await asyncio.sleep(0.1)
        self.r.chaos_rate = (self.batches - start_batches) / (time.time() - start)
        self.r.goodput = self.r.chaos_rate / self.r.baseline_rate if self.r.baseline_rate else None
        for _, kill in rejoins:  # groups still down at the end come back too
            await self._rejoin(kill)

    async def _rejoin(self, kill: ChaosKill) -> None:
        """Rejoin a killed group, unless its agent has restarted it already."""
        if kill.rejoined_at is None:
            sent = await group_control.rejoin_unless_restarted(self.agents, self.hub, kill.group)
            if sent is not None:  # else its agent restarted it at this moment, and its process event tells when
                kill.rejoined_at = sent

    async def _settle(self, timeout_s: float = 120.0) -> None:
        """Wait for the last heals, then add up the time lost per term."""
        self.r.phase = "settling"
        self.save()
        deadline = time.time() + timeout_s
        while self.open and time.time() < deadline:
            await asyncio.sleep(0.5)
        every = [t for times in self.step_times.values() for t in times]
        step_s = statistics.median(every) if every else 0.0
        self.r.median_step_s = step_s
        self.r.baseline_step_s, self.r.chaos_step_s = (
            statistics.median(self.step_times[phase]) if self.step_times.get(phase) else None
            for phase in ("baseline", "chaos"))
        measured = [k for k in self.r.kills if k.heal_s is not None]
        self.r.lost_s = {
            "detect": sum(k.detect_s for k in measured),
            "restart": sum(k.restart_s for k in measured),
            "heal": sum(k.heal_s for k in measured),
            "rollback": sum(k.survivor_steps_lost for k in self.r.kills) * step_s,
            "waiting_to_rejoin": sum(k.rejoined_at - k.killed_at for k in measured),
        }
