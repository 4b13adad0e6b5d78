"""The agents the control plane knows: each registered itself (``protocol/registration.py``).

The addresses live in SQLite, so a restarted control plane knows every agent at once; an agent
also registers again every few seconds, so one that lost its file learns them back. A group that
registers for the first time joins the board and the metrics: scaling the job is starting one
more agent.
"""

from __future__ import annotations

import time

from protocol.registration import AgentRegistration, RegisteredAgent
from service.controlplane.db import Store
from service.controlplane.groups import GroupBoard
from service.controlplane.metrics import JobMetrics


def _agent(row: dict) -> RegisteredAgent:
    return RegisteredAgent(group=row["grp"], url=row["url"], ranks_per_group=row["ranks_per_group"],
                           registered=row["registered"], renewed=row["renewed"])


class AgentRegistry:
    def __init__(self, store: Store, board: GroupBoard, metrics: JobMetrics):
        self.store = store
        self.board = board
        self.metrics = metrics
        self.urls: dict[int, str] = {}
        """Group → its agent's URL: what the agent client calls (the same dict, kept current)."""
        self.heard_at: dict[int, float] = {}
        """Group → when its agent last posted or registered (Unix time): it is there, even while
        its events still wait to be stored."""
        for row in store.agents():
            self._know(_agent(row))

    def register(self, group: int, registration: AgentRegistration) -> RegisteredAgent:
        agent = _agent(self.store.register_agent(group, str(registration.url).rstrip("/"),
                                                 registration.ranks_per_group, time.time()))
        self._know(agent)
        self.heard_at[group] = agent.renewed
        return agent

    def admit(self, group: int) -> None:
        """The group's agent spoke (it registered, or posted events): the group is part of the job
        from now on (shown, exported), and its agent is there."""
        self.heard_at[group] = time.time()
        self.board.ensure(group)
        self.metrics.ensure(group)

    def _know(self, agent: RegisteredAgent) -> None:
        self.urls[agent.group] = agent.url
        self.board.ensure(agent.group)
        self.metrics.ensure(agent.group)

    def listed(self) -> list[RegisteredAgent]:
        return [_agent(row) for row in self.store.agents()]
