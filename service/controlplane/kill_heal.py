"""The kill-heal and hang drills (the seed's chapter 10): one fault's timeline, to equal state.

SIGKILL one group (kill-heal), or hang it (its ranks SIGSTOPped, or one stuck inside its step)
and wait for its agent's watchdog to end it (hang); measure how fast the survivors notice and
commit again; rejoin it (or see its agent restart it by itself); measure the heal from a live peer; check that every group
holds bitwise identical state afterwards (per-rank fingerprints at one common step). The
measuring is :class:`~service.controlplane.timeline.FaultTimeline`'s; this module drives the
fault and waits for each milestone in turn.
"""

from __future__ import annotations

import asyncio
import time

from service.controlplane.bus import StoredEvent
from service.controlplane.drill_context import DrillContext
from protocol.injection import InjectRequest
from service.controlplane.models import HangReport, KillHealReport
from service.controlplane.timeline import FaultTimeline, Milestone


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
    step = t.fingerprint_step
    if step is not None:
        r.fingerprint_step = step
        r.fingerprints = t.fingerprints.digests(step, t.members, t.ranks_per_group)
        r.fingerprints_equal = t.fingerprints.equal_at(step)
    if isinstance(r, HangReport) and t.exit is not None:
        r.ended_at, r.fault_to_end_s = t.exit.ts, t.exit.ts - t.fault_at
        r.detected_by = "watchdog" if t.exit.action == "hung" else "agent"
        r.detected_group, r.verdict = t.group, t.exit.detail


class KillHealRun:
    def __init__(self, ctx: DrillContext, report: KillHealReport, timeout_s: float):
        self.ctx = ctx
        self.r = report
        self.timeout_s = timeout_s
        self.timeline: FaultTimeline | None = None

    async def fault(self) -> None:
        ctx, r = self.ctx, self.r
        if isinstance(r, HangReport):
            await ctx.control.inject(r.group, InjectRequest(kind=r.mode, rank=r.rank), drill_id=ctx.drill_id)
        else:
            await ctx.control.kill(r.group, at=self.timeline.fault_at, drill_id=ctx.drill_id)

    async def until(self, queue: asyncio.Queue[StoredEvent], milestone: Milestone) -> None:
        t = self.timeline
        if not t.reached(milestone):
            await self.ctx.bus.wait_for(queue, lambda e: (t.observe(e), t.reached(milestone))[1], self.timeout_s,
                                        t.describe(milestone))
        fill_report(self.r, t)
        self.ctx.save()

    async def run(self) -> None:
        ctx, r, g = self.ctx, self.r, self.r.group
        queue = ctx.bus.subscribe()
        try:
            r.phase = "kill" if not isinstance(r, HangReport) else "hang"
            # begun before the fault: the survivors' reaction can arrive while it is made
            self.timeline = FaultTimeline.begin(g, time.time(), ctx.control.board.views, ctx.settings.ranks_per_group)
            await self.fault()
            fill_report(r, self.timeline)
            ctx.save()
            if isinstance(r, HangReport):
                r.phase = "watchdog"
                await self.until(queue, Milestone.ENDED)

            r.phase = "survivors"
            await self.until(queue, Milestone.SURVIVORS_RESUMED)

            r.phase = "rejoin"
            if not self.timeline.reached(Milestone.REJOINED):
                rejoin = await ctx.control.bring_back(g, ctx.drill_id)
                if rejoin.restarted_by_agent:  # its process event tells when
                    await self.until(queue, Milestone.REJOINED)
                else:
                    self.timeline.rejoined(rejoin.at, "drill")
            fill_report(r, self.timeline)
            ctx.save()

            r.phase = "heal"
            await self.until(queue, Milestone.HEALED)

            r.phase = "fingerprints"
            await self.until(queue, Milestone.FINGERPRINTS)
        finally:
            ctx.bus.unsubscribe(queue)

