"""The partition drill: part the groups' hosts for a while and time the job through it.

``cut`` G1,G2: the two groups' agents add blackhole routes to each other's host (both still
reach the Lighthouse and every other group); the control plane's partition responder
(``partition_responder.py``) must notice the stall, evict the group its rule leaves out (the
drill predicts which from the rule and checks it), let the rest train, and rejoin the evicted
group once the routes are gone. ``isolate`` G: G's agent routes away the Lighthouse, the control
plane and every other group: to the others G is a lost node; once the routes are gone it comes
back by itself (its ranks waited for a quorum), through its agent (they had stopped and it
restarted them) or through the drill (nobody restarts them).

Both end in a heal from a live peer and every rank's fingerprint at a common step. The agents
undo the cut by their own timer, as an isolated agent cannot be told; the drill also mends it
when it ends early (failed or cancelled). The measuring is :class:`FaultTimeline`'s, as for a
kill: ``killed_at`` is the cut.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

from protocol.agent import CutRequest, CutState
from protocol.events import PartitionEvent
from protocol.network import is_loopback, resolve
from service.controlplane.drill_context import DrillContext
from service.controlplane.errors import AgentUnreachable, DomainError, DrillConflict, DrillFailed
from service.controlplane.kill_heal import fill_report
from service.controlplane.models import PartitionReport
from service.controlplane.partition import survivors
from service.controlplane.timeline import FaultTimeline, Milestone

MEND_POLL_S = 0.2


def lost_group(cut: list[int] | None, isolate: int | None, up: list[int]) -> int:
    """The group the others lose: the isolated one, or the one of the cut pair that the
    partition rule evicts when every other pair of ``up`` groups reaches each other."""
    if isolate is not None:
        return isolate
    a, b = cut
    reached = {g: {h: {g, h} != {a, b} for h in up if h != g} for g in up}
    [evicted] = survivors(reached).evict
    return evicted


def host_of(url: str) -> str:
    return urlsplit(url).hostname or url


def require_own_hosts(agents: dict[int, str], groups: list[int]) -> None:
    """A one-line 409 unless each named group's agent is on a host of its own."""
    hosts = {g: host_of(agents[g]) for g in groups}
    for g, host in hosts.items():
        try:
            address = resolve(host)
        except OSError as err:
            raise DrillConflict(f"group {g}'s agent's host {host} does not resolve here ({err})") from None
        if is_loopback(address):
            raise DrillConflict(f"group {g}'s agent listens on loopback ({host}): its group shares this host with the "
                                "others (ftctl up runs every group here), and a route cannot part groups on one host; "
                                "the partition drill needs each group on a host (or network namespace) of its own")
    if len(set(hosts.values())) < len(hosts):
        raise DrillConflict(f"groups {' and '.join(map(str, groups))} share the host {hosts[groups[0]]}: a route "
                            "cannot part them; the partition drill needs each group on a host of its own")


class PartitionRun:
    def __init__(self, ctx: DrillContext, report: PartitionReport, timeout_s: float):
        self.ctx = ctx
        self.r = report
        self.timeout_s = timeout_s
        self.cuts: dict[int, CutState] = {}
        self.timeline: FaultTimeline | None = None
        self.rejoined_event: PartitionEvent | None = None

    def _requests(self) -> dict[int, CutRequest]:
        r, agents = self.r, self.ctx.agents.agents
        if r.isolate is not None:
            others = [host_of(url) for g, url in sorted(agents.items()) if g != r.isolate]
            return {r.isolate: CutRequest(hosts=others, job_services=True, seconds=r.duration_s)}
        a, b = r.cut
        return {a: CutRequest(hosts=[host_of(agents[b])], seconds=r.duration_s),
                b: CutRequest(hosts=[host_of(agents[a])], seconds=r.duration_s)}

    async def _cut(self) -> None:
        """Every side of the cut, or none: a side that refuses mends the sides cut before it."""
        for g, request in self._requests().items():
            try:
                self.cuts[g] = await self.ctx.agents.cut(g, request)
            except DomainError:
                await self._mend()
                raise
        self.r.addresses = {str(g): ", ".join(c.addresses) for g, c in self.cuts.items()}

    async def _mend(self) -> None:
        """Undo every cut still in place now (best effort: an agent out of reach mends by its timer)."""
        for g, state in self.cuts.items():
            if state.mended_at is None:
                try:
                    self.cuts[g] = await self.ctx.agents.mend(g)
                except DomainError:
                    pass

    async def _wait_mended(self) -> None:
        """Until every cut agent says its routes are gone: its timer, at the cut's end."""
        await asyncio.sleep(max(0.0, max(c.until for c in self.cuts.values()) - time.time()))
        async with asyncio.timeout(self.timeout_s):
            for g, cut in self.cuts.items():
                while True:
                    try:
                        state = (await self.ctx.agents.status(g)).cut
                    except AgentUnreachable:
                        state = None
                    if state is not None and state.at == cut.at and state.mended_at is not None:
                        self.cuts[g] = state
                        break
                    await asyncio.sleep(MEND_POLL_S)
        self.r.mended_at = max(c.mended_at for c in self.cuts.values())

    def observe(self, e) -> None:
        self.timeline.observe(e)
        r = self.r
        if not isinstance(e, PartitionEvent) or e.ts < self.timeline.fault_at:
            return
        if e.action == "evicted" and e.group not in r.evicted:
            r.evicted.append(e.group)
            r.kept, r.rule = list(e.kept), e.detail
            if r.verdict_at is None:
                r.verdict_at, r.cut_to_verdict_s = e.ts, e.ts - self.timeline.fault_at
        elif e.action == "rejoined" and e.group == r.group:
            self.rejoined_event = e

    def fill(self) -> None:
        r, t = self.r, self.timeline
        fill_report(r, t)
        if self.rejoined_event is not None:
            r.rejoined_at, r.rejoined_by = self.rejoined_event.ts, "control-plane"
            if t.healed_commit_at is not None:
                r.rejoin_to_healed_commit_s = t.healed_commit_at - r.rejoined_at
        if r.mended_at is not None and t.healed_commit_at is not None:
            r.mend_to_healed_commit_s = t.healed_commit_at - r.mended_at
        self.ctx.save()

    async def until(self, queue, reached, what: str) -> None:
        if not reached():
            await self.ctx.bus.wait_for(queue, lambda e: (self.observe(e), reached())[1], self.timeout_s, what)
        self.fill()

    async def _come_back(self, queue, pid_at_cut: int | None) -> None:
        """The isolated group after the cut: waited through it, restarted by its agent, or by the drill."""
        t, g = self.timeline, self.r.group
        if t.reached(Milestone.REJOINED):
            return
        status = await self.ctx.agents.status(g)
        if status.state == "running" and status.pid == pid_at_cut:
            t.returned(self.r.mended_at)
        elif status.state == "running":
            await self.until(queue, lambda: t.reached(Milestone.REJOINED), f"group {g}'s agent to restart it")
        else:
            rejoin = await self.ctx.control.bring_back(g, self.ctx.drill_id)
            if rejoin.restarted_by_agent:
                await self.until(queue, lambda: t.reached(Milestone.REJOINED), f"group {g}'s agent to restart it")
            else:
                t.rejoined(rejoin.at, "drill")

    async def run(self) -> None:
        ctx, r = self.ctx, self.r
        queue = ctx.bus.subscribe()
        try:
            r.phase = "cut"
            pid_at_cut = (await ctx.agents.status(r.group)).pid
            self.timeline = t = FaultTimeline.begin(r.group, time.time(), ctx.control.board.views,
                                                    ctx.settings.ranks_per_group)
            await self._cut()
            self.fill()

            r.phase = "detect"
            if r.cut is not None:
                await self.until(queue, lambda: bool(r.evicted), "the control plane to evict a group of the cut pair")
                if r.evicted != [r.group]:
                    raise DrillFailed(f"the control plane evicted group(s) {', '.join(map(str, r.evicted))}; its rule "
                                      f"on this cut evicts group {r.group} alone")
            else:
                await self.until(queue, lambda: t.reached(Milestone.DETECTED), t.describe(Milestone.DETECTED))

            r.phase = "survivors"
            await self.until(queue, lambda: t.reached(Milestone.SURVIVORS_RESUMED),
                             t.describe(Milestone.SURVIVORS_RESUMED))

            r.phase = "cut-off"
            self.fill()
            await self._wait_mended()

            r.phase = "rejoin"
            if r.cut is not None:
                await self.until(queue, lambda: self.rejoined_event is not None,
                                 f"the control plane to rejoin group {r.group} once it reaches everyone")
            else:
                await self._come_back(queue, pid_at_cut)
            self.fill()

            r.phase = "heal"
            await self.until(queue, lambda: t.reached(Milestone.HEALED), t.describe(Milestone.HEALED))
            r.phase = "fingerprints"
            await self.until(queue, lambda: t.reached(Milestone.FINGERPRINTS), t.describe(Milestone.FINGERPRINTS))
        finally:
            await self._mend()
            ctx.bus.unsubscribe(queue)
