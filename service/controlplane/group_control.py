"""Kill and rejoin a group through its agent, and show the result on the board at once.

The REST endpoints and the drills all come through here, and so do the preconditions: a down
group cannot be killed, only a down group can rejoin, and while a drill runs it holds the
groups, so only that drill commands them. ``at`` is taken before the command: a kill lands while
the request is still running, and what it causes is timed from then.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from protocol.agent import CommandResult
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
        """The group was running already: its agent had restarted it by itself (``--auto-rejoin-delay``)."""
        return self.agent.already_running


@dataclass(frozen=True)
class Eviction:
    agent: CommandResult
    replaced_by_spare: bool


class GroupControl:
    def __init__(self, agents: AgentClient, board: GroupBoard):
        self.agents = agents
        self.board = board
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

    def require_up(self, group: int) -> None:
        view = self.board.views[group]
        if view.state == "down":
            raise GroupStateConflict(f"group {group} is already down ({view.down_reason}); "
                                     "rejoin it before drilling or killing it")

    async def kill(self, group: int, at: float | None = None, drill_id: int | None = None) -> CommandResult:
        """SIGKILL the group's processes; it shows down (killed) from ``at`` (default: now)."""
        at = time.time() if at is None else at
        self.require_up(group)
        self._check_holder(drill_id)
        agent = await self.agents.command(group, "kill")
        self.board.force(group, "down", "killed", since=at)
        return agent

    async def evict(self, group: int, drill_id: int | None = None, replace_by_spare: bool = True) -> Eviction:
        """End the group for good (down, ``evicted``: its agent will not restart it by itself); when
        the agent keeps a ready warm spare, and ``replace_by_spare``, rejoin at once so the spare
        takes its place (not for a partition: the spare is on the same side of the cut)."""
        at = time.time()
        self.require_up(group)
        self._check_holder(drill_id)
        result = await self.agents.command(group, "evict")
        self.board.force(group, "down", "evicted", since=at)
        if result.status.spare != "ready" or not replace_by_spare:
            return Eviction(result, replaced_by_spare=False)
        await self._send_rejoin(group)
        return Eviction(result, replaced_by_spare=True)

    async def inject(self, group: int, request: InjectRequest, drill_id: int) -> InjectResult:
        """A drill's fault other than a kill; the group's own events tell what follows."""
        self.require_up(group)
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
        """When the agent restarted the group already nothing is forced: the group's own events
        tell its state."""
        rejoin = Rejoin(time.time(), await self.agents.command(group, "rejoin"))
        if not rejoin.restarted_by_agent:
            self.board.force(group, "starting", None, since=rejoin.at)
        return rejoin
