"""The drain drill: take a group out for maintenance, as an operator before a firmware update does.

The control plane drains the group (``ftctl drain``): its ranks finish the step in flight,
commit it with the others and leave, and it stays down until rejoined. The drill measures what
that cost the survivors (a survivor step that failed its commit would be a step lost; their next
quorum waits for the drained group's heartbeat to expire: ``docs/recovery.md#drain``), then
rejoins the group and goes on as kill-heal: its heal from a live peer, and every rank's
fingerprint at one step.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from protocol.agent import DrainReason
from service.controlplane.drills.base import DrillBody, GroupField, TimeoutField
from service.controlplane.drills.kill_heal import KillHeal, KillHealReport
from service.controlplane.drills.rows import Row, secs

class DrainIn(DrillBody):
    """Drain one group (it commits its step and leaves), rejoin it, wait for its heal, compare fingerprints."""

    kind: Literal["drain"]
    group: int = GroupField
    reason: DrainReason | None = Field(None, description="why the group is taken out (its drained event's detail)")
    timeout_s: float | None = TimeoutField


class DrainReport(KillHealReport):
    """A kill-heal drill whose fault is a drain: nothing dies, the group leaves after a commit."""

    reason: str | None = None
    drained_at: float | None = Field(None, description="the group's drained event: its ranks gone after their commit")
    drain_s: float | None = Field(None, description="the drain asked → the group gone (its step in flight finished)")


class Drain(KillHeal):
    kind = "drain"
    Request = DrainIn
    Report = DrainReport
    fault_phase = "drain"
    fault_class = None  # planned maintenance, not a fault of the detection matrix
    summary = "drain a group (it commits its step and leaves); time what the survivors pay; rejoin, heal, compare"

    @classmethod
    def fault_rows(cls, r: dict) -> list[Row]:
        return [("fault", f"drain: {r['reason']}" if r.get("reason") else "drain"),
                ("drain → group gone", secs(r.get("drain_s")))]

    def fill(self) -> None:
        super().fill()
        r, t = self.r, self.timeline
        if t.exit is not None:
            r.drained_at, r.drain_s = t.exit.ts, t.exit.ts - t.fault_at

    async def fault(self, queue) -> None:
        ctx, r = self.ctx, self.r
        await ctx.control.drain(r.group, r.reason, ctx.drill_id)
        self.fill()
        ctx.save()
