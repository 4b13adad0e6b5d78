"""The kill-heal drill: one crash's timeline, to equal state.

SIGKILL one group; measure how fast the survivors notice and commit again; rejoin it (or see its
agent restart it by itself); measure the heal from a live peer; check that every group holds
bitwise identical state afterwards (per-rank fingerprints at one common step). The measuring is
:class:`~service.controlplane.drills.timeline.FaultTimeline`'s; this module drives the fault and
waits for each milestone in turn. The hang and partition drills are this drill with another fault.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from service.controlplane.drills.base import (
    Drill,
    DrillBody,
    FaultClass,
    GroupField,
    Prepared,
    TimeoutField,
    require_survivors,
)
from service.controlplane.drills.context import DrillServices
from service.controlplane.drills.rows import EQUAL, Row, secs, shown
from service.controlplane.drills.timeline import FaultTimeline, Milestone
from service.controlplane.recovery import RecoveryPhase


def recovery_rows(phases: list[dict]) -> list[Row]:
    """The rejoin's phases, indented under it; a part of another phase indented twice."""
    return [(("    " if p.get("within") else "  ") + p["label"],
             secs(p["seconds"]) + (f"  {p['detail']}" if p.get("detail") else "")) for p in phases]

REJOINED_BY = {"agent": "its agent (fail-over)", "drill": "the drill",
               "control-plane": "the control plane, once it reached every group", "network": "itself: its ranks "
               "waited through the cut"}


class KillHealIn(DrillBody):
    """Kill one group, wait for the survivors, rejoin it, wait for its heal, compare fingerprints."""

    kind: Literal["kill-heal"]
    group: int = GroupField
    timeout_s: float | None = TimeoutField


class KillHealReport(BaseModel):
    """What a kill-heal drill measured. Times are Unix seconds; *_s are durations."""

    group: int
    survivors: list[int] = []
    participants_before: int | None = None
    killed_at: float | None = None
    quorum_shrunk_at: float | None = Field(None, description="a survivor's quorum dropped the killed group")
    survivors_first_commit_at: float | None = Field(
        None, description="a survivor's first commit in a quorum without the killed group (shrunk, or with its spare)")
    survivors_steps_lost: int | None = Field(None, description="survivor steps not committed between kill and resume")
    rejoined_at: float | None = None
    rejoined_by: Literal["drill", "agent", "control-plane", "network"] | None = Field(
        None, description="agent: the group's agent restarted it by itself (its default) before the drill "
        "asked; control-plane: a partition drill's evicted group, rejoined once it reached everyone; network: a "
        "partition drill's isolated group, whose ranks waited through the cut")
    heal_started_at: float | None = Field(None, description="the group's heal event: state fetched and loaded")
    healed_commit_at: float | None = Field(None, description="the rejoined group's first committed step after its heal")
    healed_step: int | None = None
    heal_bytes: int | None = None
    heal_fetch_s: float | None = None
    recovery: list[RecoveryPhase] = Field([], description="rejoin → healed commit, phase by phase (rank 0); the "
                                          "phases not 'within' another add up to rejoin_to_healed_commit_s")
    detect_s: float | None = Field(None, description="kill → survivors' quorum shrank (T_d)")
    survivors_resume_s: float | None = Field(None, description="kill → survivors' first commit without the group")
    rejoin_to_healed_commit_s: float | None = None
    kill_to_full_s: float | None = Field(None, description="kill → the group's healed commit: all groups training again")
    fingerprint_step: int | None = None
    fingerprints: dict[str, dict[str, str]] | None = Field(None, description="group → rank → digest at fingerprint_step")
    fingerprints_equal: bool | None = None
    phase: str = "starting"


def fill_report(r: KillHealReport, t: FaultTimeline) -> None:
    """Copy what the timeline knows into the report a client polls."""
    r.survivors, r.participants_before, r.killed_at = sorted(t.survivors), t.participants_before, t.fault_at
    r.quorum_shrunk_at, r.survivors_first_commit_at = t.detected_at, t.survivors_resumed_at
    r.detect_s, r.survivors_resume_s = t.detect_s, t.survivors_resume_s
    if t.survivors_resumed_at is not None:
        r.survivors_steps_lost = t.survivor_steps_lost
    r.rejoined_at, r.rejoined_by = t.rejoined_at, t.rejoined_by
    if t.heal is not None:
        r.heal_started_at, r.heal_bytes, r.heal_fetch_s = t.heal.ts, t.heal.bytes, t.heal.fetch_s
    r.healed_commit_at, r.healed_step = t.healed_commit_at, t.healed_step
    r.rejoin_to_healed_commit_s, r.kill_to_full_s = t.rejoin_to_healed_commit_s, t.kill_to_full_s
    r.recovery = t.recovery
    step = t.fingerprint_step
    if step is not None:
        r.fingerprint_step = step
        r.fingerprints = t.fingerprints.digests(step, t.members, t.ranks_per_group)
        r.fingerprints_equal = t.fingerprints.equal_at(step)


class KillHeal(Drill):
    kind = "kill-heal"
    Request = KillHealIn
    Report = KillHealReport
    fault_class = FaultClass("crash", "survivors_resume_s")
    summary = "SIGKILL a group; time the survivors, the rejoin and the heal; compare every rank's state"
    fault_phase: ClassVar[str] = "kill"
    timeline: FaultTimeline

    @classmethod
    def prepare(cls, request: KillHealIn, services: DrillServices) -> Prepared:
        services.control.board.require_up(request.group)
        survivors = require_survivors(services, request.group)
        fields = request.model_dump(exclude={"kind", "group", "timeout_s"})
        return Prepared(group=request.group, report=cls.Report(group=request.group, survivors=sorted(survivors),
                                                              **fields))

    @classmethod
    def title(cls, drill: dict) -> str:
        return f"{drill['kind']} · group {drill['group']}"

    @classmethod
    def fault_rows(cls, r: dict) -> list[Row]:
        """What this kind's fault itself was (a kill: nothing more to say)."""
        return []

    @classmethod
    def heal_rows(cls, r: dict) -> list[Row]:
        """What this kind times of the group's return besides the rejoin (a kill: nothing more)."""
        return []

    @classmethod
    def rows(cls, r: dict) -> list[Row]:
        fault = cls.fault_phase
        return [
            ("phase", r.get("phase")),
            ("survivors", ", ".join(map(str, r.get("survivors", [])))),
            *cls.fault_rows(r),
            (f"{fault} → quorum shrank (detect)", secs(r.get("detect_s"))),
            (f"{fault} → survivors commit again", secs(r.get("survivors_resume_s"))),
            ("survivor steps lost", shown(r.get("survivors_steps_lost"))),
            ("rejoined by", REJOINED_BY.get(r.get("rejoined_by"), "-")),
            ("rejoin → healed commit", secs(r.get("rejoin_to_healed_commit_s"))),
            *recovery_rows(r.get("recovery") or []),
            *cls.heal_rows(r),
            (f"{fault} → all groups training", secs(r.get("kill_to_full_s"))),
            ("healed at step", shown(r.get("healed_step"))),
            ("fingerprints at step", shown(r.get("fingerprint_step"))),
            ("fingerprints equal", EQUAL.get(r.get("fingerprints_equal"), "-")),
        ]

    def begin(self) -> FaultTimeline:
        """The timeline, begun before the fault: the survivors' reaction can arrive while it is made."""
        ctx = self.ctx
        self.timeline = FaultTimeline.begin(self.r.group, time.time(), ctx.control.board.views,
                                            ctx.settings.ranks_per_group)
        return self.timeline

    def observe(self, e) -> None:
        self.timeline.observe(e)

    def fill(self) -> None:
        fill_report(self.r, self.timeline)

    async def milestone(self, queue, milestone: Milestone) -> None:
        await self.until(queue, lambda: self.timeline.reached(milestone), self.timeline.describe(milestone))

    async def fault(self, queue) -> None:
        """Make the fault and wait until it took effect."""
        await self.ctx.control.kill(self.r.group, drill_id=self.ctx.drill_id)
        self.fill()
        self.ctx.save()

    async def bring_back(self, queue) -> None:
        """Rejoin the group, unless its agent restarted it already (its process event tells when)."""
        ctx, g, t = self.ctx, self.r.group, self.timeline
        if not t.reached(Milestone.REJOINED):
            rejoin = await ctx.control.bring_back(g, ctx.drill_id)
            if rejoin.restarted_by_agent:
                await self.milestone(queue, Milestone.REJOINED)
            else:
                t.rejoined(rejoin.at, "drill")
        self.fill()
        self.ctx.save()

    async def run(self) -> None:
        ctx, r = self.ctx, self.r
        r.phase = self.fault_phase
        queue = ctx.bus.subscribe()
        try:
            self.begin()
            await self.fault(queue)
            r.phase = "survivors"
            await self.milestone(queue, Milestone.SURVIVORS_RESUMED)
            r.phase = "rejoin"
            await self.bring_back(queue)
            r.phase = "heal"
            await self.milestone(queue, Milestone.HEALED)
            r.phase = "fingerprints"
            await self.milestone(queue, Milestone.FINGERPRINTS)
        finally:
            ctx.bus.unsubscribe(queue)
