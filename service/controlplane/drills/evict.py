"""The evict drill: take a group out for good, as an operator replacing a suspect node would,
and time its warm spare taking its place.

The control plane evicts the group (its agent SIGKILLs it and will not restart it by itself)
and, when the group's warm spare is ready, promotes it at once; without one the drill rejoins
the group cold. Then as kill-heal: the survivors' next commit, the replacement's heal from a
live peer, and every rank's fingerprint at one step.
"""

from __future__ import annotations

from typing import Literal

from service.controlplane.drills.base import DrillBody, GroupField, TimeoutField
from service.controlplane.drills.kill_heal import KillHeal


class EvictIn(DrillBody):
    """Evict one group; its warm spare (or a cold start) takes its place and heals."""

    kind: Literal["evict"]
    group: int = GroupField
    timeout_s: float | None = TimeoutField


class Evict(KillHeal):
    kind = "evict"
    Request = EvictIn
    fault_phase = "evict"
    fault_class = None  # a planned replacement, not a fault of the detection matrix
    summary = "evict a group for good; its warm spare takes its place and heals from a peer"

    async def fault(self, queue) -> None:
        ctx, r = self.ctx, self.r
        eviction = await ctx.control.evict(r.group, ctx.drill_id)
        if eviction.rejoin is not None:  # its warm spare, promoted by the eviction itself
            self.timeline.rejoined(eviction.rejoin.at, "drill")
        self.fill()
        ctx.save()
