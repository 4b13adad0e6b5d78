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
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, WithJsonSchema, model_validator

from protocol.agent import CutRequest, CutState
from protocol.events import PartitionEvent
from protocol.network import is_loopback, resolve
from service.controlplane.drills.base import MAX_ID, DrillBody, FaultClass, Prepared, TimeoutField, require_survivors
from service.controlplane.drills.context import DrillServices
from service.controlplane.drills.kill_heal import KillHeal, KillHealReport
from service.controlplane.drills.rows import Row, secs
from service.controlplane.drills.timeline import Milestone
from service.controlplane.errors import AgentUnreachable, DomainError, DrillConflict, DrillFailed
from service.controlplane.partition import survivors

MEND_POLL_S = 0.2


class PartitionIn(DrillBody):
    """Cut two groups' hosts apart (``cut``; both still reach the rest), or one group's host off
    from the whole job (``isolate``), for ``duration_s``; the agents make the cut (blackhole
    routes) and undo it. Needs each group on a host of its own, and agents with CAP_NET_ADMIN."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["cut"]}, {"required": ["isolate"]}]})

    kind: Literal["partition"]
    cut: Annotated[list[Annotated[int, Field(ge=0, le=MAX_ID)]] | None, WithJsonSchema(
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_ID}, "minItems": 2,
         "maxItems": 2, "uniqueItems": True})] = Field(
        None, min_length=2, max_length=2, description="two groups whose hosts stop reaching each other")
    isolate: Annotated[int | None, WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_ID})] = Field(
        None, ge=0, le=MAX_ID, description="the group whose host stops reaching the Lighthouse, the control plane "
        "and every other group")
    duration_s: float = Field(20.0, gt=0, le=3600, description="how long the cut lasts; the agents undo it")
    timeout_s: float | None = TimeoutField

    @property
    def groups(self) -> list[int]:
        """The groups named: the cut pair, or the isolated group."""
        return self.cut if self.cut is not None else [self.isolate]

    @model_validator(mode="after")
    def _one_fault(self) -> "PartitionIn":
        if (self.cut is None) == (self.isolate is None):
            raise ValueError("name either cut (two groups) or isolate (one group)")
        if self.cut is not None and self.cut[0] == self.cut[1]:
            raise ValueError(f"cut needs two different groups, not {self.cut[0]} twice")
        return self


class PartitionReport(KillHealReport):
    """What a partition drill measured. ``group`` is the group the others lose: the isolated one,
    or the one of the cut pair the rule evicts (predicted from the rule, checked against what the
    control plane did); ``killed_at`` is the cut. Times are Unix seconds; *_s are durations."""

    cut: list[int] | None = None
    isolate: int | None = None
    duration_s: float
    addresses: dict[str, str] = Field(default_factory=dict, description="group → its host's address, as cut")
    mended_at: float | None = Field(None, description="the agents removed the cut's routes")
    verdict_at: float | None = Field(None, description="cut: the control plane evicted a group for the partition")
    cut_to_verdict_s: float | None = Field(None, description="cut → the control plane's eviction")
    evicted: list[int] = Field(default_factory=list, description="the groups the control plane evicted for it")
    kept: list[int] = Field(default_factory=list, description="the largest set of groups that all reach each other")
    rule: str | None = Field(None, description="the control plane's reason, as its partition event says it")
    mend_to_healed_commit_s: float | None = Field(None, description="mended → the group's healed commit")


def lost_group(cut: list[int] | None, isolate: int | None, up: list[int]) -> int:
    """The group the others lose: the isolated one, or the one of the cut pair that the
    partition rule evicts when every other pair of ``up`` groups reaches each other."""
    if isolate is not None:
        return isolate
    a, b = cut
    if not {a, b} <= set(up):
        raise DrillConflict(f"groups {a} and {b} must both be running to be cut apart (running: "
                            f"{', '.join(map(str, sorted(up))) or 'none'}); wait for them to start")
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


class Partition(KillHeal):
    kind = "partition"
    Request = PartitionIn
    Report = PartitionReport
    fault_class = FaultClass("partition", "survivors_resume_s")
    fault_phase = "cut"
    summary = "cut two groups' hosts apart, or one off from the job; evict, go on, mend, rejoin, heal"

    @classmethod
    def prepare(cls, request: PartitionIn, services: DrillServices) -> Prepared:
        """The groups named must each be on a host of their own (checked on their agents'
        addresses here; the agents refuse what else cannot be cut), and the group the others
        lose must leave at least one of them training."""
        for g in request.groups:
            services.control.board.require_up(g)
        lost = lost_group(request.cut, request.isolate, services.control.board.up())
        survivors_ = require_survivors(services, lost)
        agents = services.agents.agents
        unregistered = [g for g in request.groups if g not in agents]
        if unregistered:
            raise DrillConflict(f"no agent is registered for group(s) {', '.join(map(str, unregistered))}: the "
                                "partition drill cuts the network from the groups' own agents")
        require_own_hosts({g: agents[g] for g in request.groups}, request.groups)
        return Prepared(group=lost, report=PartitionReport(group=lost, survivors=sorted(survivors_), cut=request.cut,
                                                           isolate=request.isolate, duration_s=request.duration_s))

    @classmethod
    def fault_rows(cls, r: dict) -> list[Row]:
        """The cut, and the control plane's verdict on it."""
        cut = f"groups {r['cut'][0]} and {r['cut'][1]} apart" if r.get("cut") else f"group {r['isolate']} from the job"
        evicted = r.get("evicted") or []
        return [
            ("cut", f"{cut} for {r['duration_s']:g} s"),
            ("hosts cut", "; ".join(f"group {g}: {a}" for g, a in sorted((r.get("addresses") or {}).items())) or "-"),
            ("cut → evicted", f"group(s) {', '.join(map(str, evicted))} after {r['cut_to_verdict_s']:.2f} s"
             if evicted and r.get("cut_to_verdict_s") is not None
             else "none: a lost node, the quorum leaves it out" if r.get("isolate") is not None else "-"),
            ("kept", ", ".join(map(str, r.get("kept") or [])) or "-"),
            ("rule", r.get("rule") or "-"),
        ]

    @classmethod
    def heal_rows(cls, r: dict) -> list[Row]:
        return [("mended → healed commit", secs(r.get("mend_to_healed_commit_s")))]

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.cuts: dict[int, CutState] = {}
        self.rejoined_event: PartitionEvent | None = None
        self.pid_at_cut: int | None = None

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
        super().observe(e)
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
        super().fill()
        r, t = self.r, self.timeline
        if self.rejoined_event is not None:
            r.rejoined_at, r.rejoined_by = self.rejoined_event.ts, "control-plane"
            if t.healed_commit_at is not None:
                r.rejoin_to_healed_commit_s = t.healed_commit_at - r.rejoined_at
        if r.mended_at is not None and t.healed_commit_at is not None:
            r.mend_to_healed_commit_s = t.healed_commit_at - r.mended_at

    async def _come_back(self, queue) -> None:
        """The isolated group after the cut: waited through it, restarted by its agent, or by the drill."""
        t, g = self.timeline, self.r.group
        if t.reached(Milestone.REJOINED):
            return
        status = await self.ctx.agents.status(g)
        if status.state == "running" and status.pid == self.pid_at_cut:
            t.returned(self.r.mended_at)
        elif status.state == "running":
            await self.until(queue, lambda: t.reached(Milestone.REJOINED), f"group {g}'s agent to restart it")
        else:
            rejoin = await self.ctx.control.bring_back(g, self.ctx.drill_id)
            if rejoin.restarted_by_agent:
                await self.until(queue, lambda: t.reached(Milestone.REJOINED), f"group {g}'s agent to restart it")
            else:
                t.rejoined(rejoin.at, "drill")

    async def fault(self, queue) -> None:
        """Cut, and wait until the control plane evicts the group the rule leaves out (cut) or the
        others' quorum leaves it out (isolate)."""
        r = self.r
        await self._cut()
        self.fill()
        self.ctx.save()
        r.phase = "detect"
        if r.cut is None:
            await self.milestone(queue, Milestone.DETECTED)
            return
        await self.until(queue, lambda: bool(r.evicted), "the control plane to evict a group of the cut pair")
        if r.evicted != [r.group]:
            raise DrillFailed(f"the control plane evicted group(s) {', '.join(map(str, r.evicted))}; its rule "
                              f"on this cut evicts group {r.group} alone")

    async def bring_back(self, queue) -> None:
        """Wait out the cut; then the control plane rejoins the evicted group (cut), or the isolated
        group comes back by itself, through its agent or through the drill."""
        r = self.r
        r.phase = "cut-off"
        self.fill()
        self.ctx.save()
        await self._wait_mended()
        r.phase = "rejoin"
        if r.cut is not None:
            await self.until(queue, lambda: self.rejoined_event is not None,
                             f"the control plane to rejoin group {r.group} once it reaches everyone")
        else:
            await self._come_back(queue)
        self.fill()
        self.ctx.save()

    async def run(self) -> None:
        self.pid_at_cut = (await self.ctx.agents.status(self.r.group)).pid
        try:
            await super().run()
        finally:
            await self._mend()
