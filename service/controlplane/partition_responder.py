"""Breaks the loop a partition between groups causes (``partition.py`` has the rule).

Listening on the bus, the responder starts a round of probes (every up group's agent says which
other groups' agents it reaches) when a commit fails, or when no training group has committed
for ``stall_s`` (max of :data:`STALL_FLOOR_S` and :data:`STALL_STEPS` median steps, by this
server's clock). The trainers' collective watch (``trainer/collective_watch.py``) usually comes
first: it ends the all-reduce on the cut in about a second, the commit fails, and the pair's
higher-numbered group keeps out of quorums by itself, as this rule decides. With the watch off,
every group waits in its all-reduce until the collective timeout, then fails, and torchft at once
forms a quorum with every group again (all still heartbeat); a group that then dials a peer it
cannot reach waits out gloo's connect before anything moves: the stall trigger evicts before
that quorum forms. Rounds are at least ``probe_every_s`` apart.

Where two answering groups do not reach each other, the groups outside the rule's set are
evicted through their agents (down, ``evicted``; never replaced by their warm spare, which sits
on the same side of the cut), and a ``partition`` event says why. Every ``heal_every_s`` the
agent of each group evicted so is asked again; once it reaches every up group, the group is
rejoined (it heals from a live peer) and a second event says so. While a drill holds the
groups, nothing is evicted or rejoined, unless it is a partition drill: that one watches this
responder do its work.
"""

from __future__ import annotations

import asyncio
import logging
import time

from protocol.agent import ProbeRequest, ProbeResult
from protocol.events import CommitFailedEvent, PartitionEvent, StepEvent, speaks_for_group
from service.controlplane.agents import AgentClient
from service.controlplane.bus import EventBus
from service.controlplane.errors import DomainError
from service.controlplane.group_control import GroupControl
from service.controlplane.ingest import Ingestor
from service.controlplane.partition import PartitionVerdict, survivors

log = logging.getLogger("controlplane.partition")

PROBE_EVERY_S = 5.0
"""At most one round of probes this often: a partition stalls and fails every group at once."""
STALL_FLOOR_S = 2.0
STALL_STEPS = 5.0
HEAL_EVERY_S = 2.0
PROBE_TIMEOUT_S = 3.0
"""A peer's host that has not answered a connection within this is not reached. A cut that
drops packets costs this long to see; a blackhole route or a host that answers is seen at once."""
ROUNDS = 2
"""Probe rounds back to back per check; a pair reached in either is not cut: a cut persists, a
busy agent's missed connection seldom repeats."""


class PartitionResponder:
    def __init__(self, bus: EventBus, control: GroupControl, agents: AgentClient, ingest: Ingestor,
                 probe_every_s: float = PROBE_EVERY_S, heal_every_s: float = HEAL_EVERY_S):
        self.bus = bus
        self.control = control
        self.agents = agents
        self.ingest = ingest
        self.probe_every_s = probe_every_s
        self.heal_every_s = heal_every_s
        self.partitioned: set[int] = set()
        """groups this responder evicted, waiting to reach the others again"""
        self._committed: dict[int, float] = {}
        """group → when this server last heard of a step it committed (monotonic)"""
        self._next_probe = 0.0
        self._round: asyncio.Task | None = None

    async def run(self) -> None:
        queue = self.bus.subscribe()
        helpers = [asyncio.create_task(self._heal_forever()), asyncio.create_task(self._watch_stalls())]
        try:
            while True:
                match (await queue.get()).event:
                    case StepEvent(committed=True) as e if speaks_for_group(e):
                        self._committed[e.group] = time.monotonic()
                    case CommitFailedEvent():
                        self._probe_soon()
        finally:
            for task in helpers:
                task.cancel()
            self.bus.unsubscribe(queue)

    def stall_s(self) -> float:
        median = self.control.board.median_step_s()
        return max(STALL_FLOOR_S, STALL_STEPS * median) if median else STALL_FLOOR_S

    def stalled(self, now: float) -> bool:
        """At least two groups train and none of them has committed for :meth:`stall_s`."""
        training = self.control.board.training()
        limit = self.stall_s()
        return len(training) >= 2 and all(now - self._committed.get(g, now) > limit for g in training)

    async def _watch_stalls(self) -> None:
        while True:
            await asyncio.sleep(STALL_FLOOR_S / 4)
            if self.stalled(time.monotonic()):
                self._probe_soon()

    def _probe_soon(self) -> None:
        """A round of probes now, unless one runs or ran less than ``probe_every_s`` ago."""
        now = time.monotonic()
        if now < self._next_probe or (self._round is not None and not self._round.done()):
            return
        self._next_probe = now + self.probe_every_s
        self._round = asyncio.create_task(self._logged(self.check()))

    @staticmethod
    async def _logged(work) -> None:
        """A round or a heal that fails unexpectedly is logged; the responder goes on."""
        try:
            await work
        except Exception:
            log.exception("partition check failed")

    def _up(self) -> list[int]:
        return [g for g in self.control.board.up() if g in self.agents.agents]

    async def _reached(self, group: int, peers: list[int]) -> dict[int, bool] | None:
        """Which of ``peers`` the group's agent reaches; None when the agent does not answer."""
        request = ProbeRequest(peers={h: self.agents.agents[h] for h in peers}, timeout_s=PROBE_TIMEOUT_S)
        try:
            answer: ProbeResult = await self.agents.probe(group, request)
        except DomainError:
            return None
        return answer.reached

    async def check(self) -> PartitionVerdict | None:
        """One round: probe, decide, evict. Returns the verdict, or None with fewer than two answers."""
        up = self._up()
        reached: dict[int, dict[int, bool]] = {}
        for _ in range(ROUNDS):
            answers = await asyncio.gather(*(self._reached(g, [h for h in up if h != g]) for g in up))
            for g, row in zip(up, answers):
                if row is not None:
                    reached[g] = {h: ok or reached.get(g, {}).get(h, False) for h, ok in row.items()}
        if len(reached) < 2:
            return None
        verdict = await asyncio.to_thread(survivors, reached)
        if not verdict.partitioned:
            return verdict
        free, drill = self.control.holder_lets("partition")
        if not free:
            log.warning("groups %s cannot all reach each other, but drill %d holds the groups: nothing evicted",
                        ", ".join(f"{g}-{h}" for g, h in verdict.cut), self.control.holder)
            return verdict
        for g in verdict.evict:
            await self._evict(g, verdict, drill)
        return verdict

    async def _evict(self, g: int, verdict: PartitionVerdict, drill: int | None) -> None:
        """Evict one group the rule leaves out, and say why."""
        unreached = sorted({h for pair in verdict.cut if g in pair for h in pair} - {g})
        try:
            await self.control.evict(g, drill_id=drill, replace_by_spare=False)
        except DomainError as err:
            log.warning("not evicting partitioned group %d: %s", g, err)
            return
        self.partitioned.add(g)
        detail = (f"does not reach group(s) {', '.join(map(str, unreached))} while every group reaches the "
                  f"Lighthouse; kept groups {', '.join(map(str, verdict.keep))}: the largest set that all reach "
                  f"each other (ties: the lowest group numbers)")
        log.warning("evicted partitioned group %d: %s", g, detail)
        self.ingest.record([PartitionEvent(group=g, ts=time.time(), action="evicted", kept=list(verdict.keep),
                                           unreached=unreached, detail=detail)])

    async def _heal_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heal_every_s)
            for g in sorted(self.partitioned):
                await self._logged(self.heal(g))

    async def heal(self, group: int) -> bool:
        """Rejoin ``group`` once its agent reaches every up group again; whether it did."""
        if self.control.board.views[group].state != "down":
            self.partitioned.discard(group)  # somebody rejoined it
            return False
        peers = [h for h in self._up() if h != group]
        row = await self._reached(group, peers)
        free, drill = self.control.holder_lets("partition")
        if row is None or not all(row.values()) or not free:
            return False
        try:
            await self.control.rejoin(group, drill_id=drill)
        except DomainError as err:
            log.warning("not rejoining group %d yet: %s", group, err)
            return False
        self.partitioned.discard(group)
        detail = f"reaches group(s) {', '.join(map(str, peers))} again: rejoined, it heals from a live peer"
        log.warning("partition healed: group %d %s", group, detail)
        self.ingest.record([PartitionEvent(group=group, ts=time.time(), action="rejoined", kept=peers, unreached=[],
                                           detail=detail)])
        return True
