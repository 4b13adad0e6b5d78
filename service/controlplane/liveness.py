"""Lost groups: the agent does not answer and the Lighthouse has no heartbeat from the group.

A node that dies takes the group's agent with it, so no process event ever says the group is
down: the control plane would show it training. Every ``liveness_interval_s`` the monitor asks
the agent of each up group that has been quiet for that long (no event arrived: a group whose
events keep coming has an agent that forwards them, and asking a thousand busy agents every
second would cost more than the training's own traffic) for its status, and then the Lighthouse
for its heartbeats. A group whose agent has said nothing (no answer, no event) for
``lost_after_s``, and that no fresh heartbeat speaks for, is lost: the
monitor records a ``process`` event with action ``lost`` as an agent would its exit, so the
board, the metrics, the page and a running drill see it go down the same way. Either sign
alone is not enough: an agent can be slow while its group trains, and a heartbeat can lapse
while the agent is restarting the group. When the Lighthouse itself does not answer nothing is
judged. A lost group whose agent answers again with its processes running is joining again;
its next committed step shows it training.

The decision is :func:`lost_groups`, a pure function of the time and what was seen.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from protocol.agent import AgentStatus
from protocol.events import ProcessEvent
from protocol.lighthouse import LighthouseStatus
from service.controlplane.agents import AgentClient
from service.controlplane.errors import AgentUnreachable, NoAgent
from service.controlplane.groups import GroupBoard
from service.controlplane.ingest import Ingestor
from service.controlplane.lighthouse import LighthouseClient, LighthouseUnreachable

log = logging.getLogger("controlplane.liveness")

MAX_ASKING = 16
"""Agents asked at once. httpx's pool scans every queued request against every connection, so a
round asking a thousand agents at once (every group quiet: a control plane that just started, a
stalled network) would cost seconds of the event loop; 16 at a time answer as fast."""


def beating_groups(status: LighthouseStatus) -> set[int]:
    """Groups with at least one heartbeat the Lighthouse does not yet call stale."""
    return {h.group for h in status.heartbeats if h.group is not None and not h.stale}


def quiet_groups(now: float, last_heard: Mapping[int, float | None], quiet_s: float) -> set[int]:
    """The groups nothing was heard from for ``quiet_s`` (or ever): only their agents are asked."""
    return {g for g, ts in last_heard.items() if ts is None or now - ts >= quiet_s}


def groups_to_ask(quiet: set[int], beating: set[int], lost: list[int]) -> list[int]:
    """The agents asked this round: the quiet groups that no fresh heartbeat speaks for (a group
    that heartbeats is not lost, whatever its agent says), and the lost ones (are they back?)."""
    return sorted(quiet - beating) + [g for g in lost if g not in quiet]


def lost_groups(now: float, unanswered_since: Mapping[int, float], beating: set[int], lost_after_s: float) -> set[int]:
    """The groups whose agent has been silent ``lost_after_s`` and that no heartbeat speaks for."""
    return {g for g, since in unanswered_since.items() if now - since >= lost_after_s and g not in beating}


class LivenessMonitor:
    def __init__(self, board: GroupBoard, agents: AgentClient, lighthouse: LighthouseClient, ingest: Ingestor,
                 interval_s: float, lost_after_s: float, heard_at: Mapping[int, float]):
        """``heard_at``: when each group's agent last posted (its events may still wait to be stored)."""
        self.heard_at = heard_at
        self.board = board
        self.agents = agents
        self.lighthouse = lighthouse
        self.ingest = ingest
        self.interval_s = interval_s
        self.lost_after_s = lost_after_s
        self.unanswered_since: dict[int, float] = {}
        self.answered: dict[int, float] = {}
        self._asking = asyncio.Semaphore(MAX_ASKING)

    async def _status(self, group: int) -> AgentStatus | None:
        """The agent's status, or None when it did not answer within half of ``lost_after_s``
        (a stopped agent's kernel still accepts the connection: only a timeout tells)."""
        async with self._asking:
            try:
                return await asyncio.wait_for(self.agents.status(group), self.lost_after_s / 2)
            except (AgentUnreachable, TimeoutError):
                return None

    async def check(self) -> set[int]:
        """One round; returns the groups it found lost."""
        views = self.board.views
        asked = time.time()
        up = [g for g in self.board.up() if g in self.agents.agents]
        quiet = quiet_groups(asked, {g: self._last_word(g) for g in up}, self.interval_s)
        lost = [g for g, v in views.items() if v.down_reason == "lost" and g in self.agents.agents]
        ask = groups_to_ask(quiet, (await self._beating() or set()) if quiet else set(), lost)
        answers = await asyncio.gather(*(self._status(g) for g in ask))
        now = time.time()
        for g, status in zip(ask, answers):
            if status is not None:
                self.answered[g] = now
                self.unanswered_since.pop(g, None)
                if g in lost and status.state == "running":  # its ranks' next events show it up
                    log.info("group %d's agent answers again with its processes running", g)
            elif g in up:  # silent since its last word
                self.unanswered_since.setdefault(g, min(asked, self._last_word(g) or asked))
        for g in list(self.unanswered_since):
            if g not in ask:
                del self.unanswered_since[g]
        if not self.unanswered_since:
            return set()
        beating = await self._beating()  # again: the asking took time
        if beating is None:
            return set()  # without the Lighthouse's view nothing is judged
        found = lost_groups(now, self.unanswered_since, beating, self.lost_after_s)
        for g in sorted(found):
            silent = now - self.unanswered_since.pop(g)
            detail = f"its agent has not answered for {silent:.1f} s and the Lighthouse has no heartbeat from it"
            log.warning("group %d lost: %s", g, detail)
            self.ingest.record([ProcessEvent(group=g, ts=now, action="lost", detail=detail)])
        return found

    async def _beating(self) -> set[int] | None:
        """The groups the Lighthouse has a fresh heartbeat from; None when it does not answer.
        Asked before the agents too, when some are quiet: a slow control plane then does not add
        a thousand requests to agents of its own to its load."""
        try:
            return beating_groups(await self.lighthouse.status())
        except LighthouseUnreachable:
            return None

    def _last_word(self, group: int) -> float | None:
        """When the group's agent last said anything: an answer, a post, an event it forwarded."""
        heard = max(self.answered.get(group, 0.0), self.heard_at.get(group, 0.0),
                    self.board.views[group].last_event_ts or 0.0)
        return heard or None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check()
            except NoAgent:
                pass
            except Exception:  # one bad round must not end the monitoring
                log.exception("liveness check failed")
