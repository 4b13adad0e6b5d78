"""Kill, evict and rejoin a group through its agent; the board learns of it from the event.

The REST endpoints and the drills all come through here, and so do the preconditions: a down
group cannot be killed, only a down group can rejoin, and while a drill runs it holds the
groups, so only that drill commands them. The board has one writer, the events: the agent's
answer to a command carries the process event it caused (``killed``, ``evicted``, ``started``),
which is recorded at once through the ingest path, the same event (same ``eid``) its forwarder
sends; whichever arrives first is stored, the other is a duplicate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from typing import Callable

from protocol.agent import CommandResult, DrainRequest, KillRequest
from protocol.events import Event
from protocol.injection import InjectRequest, InjectResult
from service.controlplane.agents import AgentClient
from service.controlplane.errors import DrillConflict, GroupStateConflict
from service.controlplane.groups import GroupBoard


@dataclass(frozen=True)
class Rejoin:
    at: float
    agent: CommandResult

    @property
    def restarted_by_agent(self) -> bool:
        """The group was running already: its agent had restarted it by itself."""
        return self.agent.already_running


@dataclass(frozen=True)
class Eviction:
    agent: CommandResult
    rejoin: Rejoin | None = None
    """the rejoin that promoted the group's warm spare in its place, if one was ready"""

    @property
    def replaced_by_spare(self) -> bool:
        return self.rejoin is not None


class GroupControl:
    def __init__(self, agents: AgentClient, board: GroupBoard, record: Callable[[list[Event]], int]):
        """``record``: store and publish events the control plane holds (the ingest path's)."""
        self.agents = agents
        self.board = board
        self.record = record
        self.holder: int | None = None
        self.holder_kind: str | None = None

    def hold(self, drill_id: int, kind: str) -> None:
        """While drill ``drill_id`` runs, only it may command the groups."""
        self.holder, self.holder_kind = drill_id, kind

    def release(self, drill_id: int) -> None:
        if self.holder == drill_id:
            self.holder = self.holder_kind = None

    def holder_lets(self, kind: str) -> tuple[bool, int | None]:
        """Whether the control plane's own responses may act now, while a drill of ``kind`` may
        hold the groups (a partition drill watches the partition responder act), and the drill id
        to act under."""
        if self.holder is None:
            return True, None
        return self.holder_kind == kind, self.holder

    def _check_holder(self, drill_id: int | None) -> None:
        if self.holder is not None and drill_id != self.holder:
            raise DrillConflict(f"drill {self.holder} is running; it controls the groups until it ends")

    def _command(self, result: CommandResult) -> CommandResult:
        """Fold the event the command caused into the board now, as the agent also sends it."""
        if result.event is not None:
            self.record([result.event])
        return result

    async def kill(self, group: int, drill_id: int | None = None) -> CommandResult:
        """SIGKILL the group's processes; it shows down (killed) as its agent's event says. A
        person's kill stays down until a rejoin; a drill's stands for a node loss, and the
        group's agent brings it back as after a crash (unless it runs with ``--no-auto-rejoin``)."""
        self.board.require_up(group)
        self._check_holder(drill_id)
        return self._command(await self.agents.command(group, "kill", KillRequest(fault=drill_id is not None)))

    async def drain(self, group: int, reason: str | None = None, drill_id: int | None = None) -> CommandResult:
        """Take the group out on purpose: it commits its step and leaves; down (drained) until a rejoin."""
        self.board.require_up(group)
        self._check_holder(drill_id)
        return self._command(await self.agents.command(group, "drain", DrainRequest(reason=reason)))

    async def evict(self, group: int, drill_id: int | None = None, replace_by_spare: bool = True) -> Eviction:
        """End the group for good (down, ``evicted``: its agent will not restart it by itself); when
        the agent keeps a ready warm spare, and ``replace_by_spare``, rejoin at once so the spare
        takes its place (not for a partition: the spare is on the same side of the cut)."""
        self.board.require_up(group)
        self._check_holder(drill_id)
        result = self._command(await self.agents.command(group, "evict"))
        if result.status.spare != "ready" or not replace_by_spare:
            return Eviction(result)
        return Eviction(result, await self._send_rejoin(group))

    async def inject(self, group: int, request: InjectRequest, drill_id: int) -> InjectResult:
        """A drill's fault other than a kill; the group's own events tell what follows."""
        self.board.require_up(group)
        self._check_holder(drill_id)
        return await self.agents.inject(group, request)

    async def rejoin(self, group: int, drill_id: int | None = None) -> CommandResult:
        """Start a down group again (the REST call): it joins the quorum and heals from a peer."""
        view = self.board.views[group]
        if view.state != "down":
            raise GroupStateConflict(f"group {group} is {view.state}, not down; only a down group can rejoin")
        self._check_holder(drill_id)
        rejoin = await self._send_rejoin(group)
        if rejoin.restarted_by_agent:
            raise GroupStateConflict(f"group {group} is running again already: its agent restarted it")
        return rejoin.agent

    async def bring_back(self, group: int, drill_id: int) -> Rejoin:
        """A drill's rejoin of the group it killed, unless its agent has restarted it already."""
        self._check_holder(drill_id)
        return await self._send_rejoin(group)

    async def _send_rejoin(self, group: int) -> Rejoin:
        """When the agent restarted the group already there is no new event: the group's own
        events tell its state."""
        at = time.time()
        return Rejoin(at, self._command(await self.agents.command(group, "rejoin")))
