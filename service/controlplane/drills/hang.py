"""The hang drill: a group that stops making progress without dying; the watchdog must end it.

The group's ranks are SIGSTOPped (``stop``), or one rank sleeps inside its step (``stuck``); the
group's agent's hang watchdog must end it, and then the drill goes on as a kill-heal: survivors,
rejoin, heal, fingerprints.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from protocol.injection import HangKind, InjectRequest
from service.controlplane.drills.base import (
    MAX_ID,
    DrillBody,
    FaultClass,
    GroupField,
    Prepared,
    TimeoutField,
    require_rank,
)
from service.controlplane.drills.context import DrillServices
from service.controlplane.drills.kill_heal import KillHeal, KillHealReport
from service.controlplane.drills.rows import Row, secs, shown
from service.controlplane.drills.timeline import Milestone


class HangIn(DrillBody):
    """Hang one group (its ranks stopped, or one stuck inside its step); the watchdog must end it."""

    kind: Literal["hang"]
    group: int = GroupField
    rank: int | None = Field(None, ge=0, le=MAX_ID, description="only this rank of the group (default: every rank)")
    mode: HangKind = Field("stop", description="stop: SIGSTOP the ranks; stuck: the rank sleeps inside its step")
    timeout_s: float | None = TimeoutField


class HangReport(KillHealReport):
    """A kill-heal drill whose fault is a hang: nothing dies until the watchdog ends the group."""

    mode: HangKind = "stop"
    rank: int | None = None
    ended_at: float | None = Field(None, description="the group's processes ended (the watchdog's kill)")
    detected_by: Literal["watchdog", "agent"] | None = Field(
        None, description="watchdog: the agent's hang watchdog ended the group; agent: its processes exited")
    detected_group: int | None = Field(None, description="the group the watchdog ended")
    verdict: str | None = Field(None, description="the watchdog's reason")
    fault_to_end_s: float | None = Field(None, description="the hang began → the group was ended")


class Hang(KillHeal):
    kind = "hang"
    Request = HangIn
    Report = HangReport
    fault_class = FaultClass("hang", "survivors_resume_s")
    fault_phase = "hang"
    summary = "hang a group (SIGSTOP, or a rank stuck in its step); the watchdog must end it; then as kill-heal"

    @classmethod
    def prepare(cls, request: HangIn, services: DrillServices) -> Prepared:
        require_rank(services, request.group, request.rank)
        return super().prepare(request, services)

    @classmethod
    def fault_rows(cls, r: dict) -> list[Row]:
        return [("fault", f"{r['mode']} " + (f"rank {r['rank']}" if r.get("rank") is not None else "every rank")),
                ("ended by", {"watchdog": "its agent's watchdog", "agent": "its processes exiting"}.get(
                    r.get("detected_by"), "-")),
                ("hang → group ended", secs(r.get("fault_to_end_s"))), ("verdict", shown(r.get("verdict")))]

    def fill(self) -> None:
        super().fill()
        r, t = self.r, self.timeline
        if t.exit is not None:
            r.ended_at, r.fault_to_end_s = t.exit.ts, t.exit.ts - t.fault_at
            r.detected_by = "watchdog" if t.exit.action == "hung" else "agent"
            r.detected_group, r.verdict = t.group, t.exit.detail

    async def fault(self, queue) -> None:
        ctx, r = self.ctx, self.r
        await ctx.control.inject(r.group, InjectRequest(kind=r.mode, rank=r.rank), drill_id=ctx.drill_id)
        self.fill()
        ctx.save()
        r.phase = "watchdog"
        await self.milestone(queue, Milestone.ENDED)
