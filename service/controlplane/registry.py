"""The agents the control plane knows: each registered itself (``protocol/registration.py``).

The addresses live in SQLite, so a restarted control plane knows every agent at once; an agent
also registers again every few seconds, so one that lost its file learns them back. A group that
registers for the first time joins the board and the metrics: scaling the job is starting one
more agent.
"""

from __future__ import annotations

import secrets
import time

import httpx
from pydantic import ValidationError

from protocol.registration import (CHALLENGE_PATH, AgentRegistration, ChallengeAnswer, RegisteredAgent, normal_url,
                                   registration_proof)
from protocol.tokens import group_token
from service.controlplane.db import Store
from service.controlplane.errors import UnprovenAgent
from service.controlplane.groups import GroupBoard
from service.controlplane.metrics import JobMetrics


def _agent(row: dict) -> RegisteredAgent:
    return RegisteredAgent(group=row["grp"], url=row["url"], ranks_per_group=row["ranks_per_group"],
                           registered=row["registered"], renewed=row["renewed"])


CHALLENGE_TIMEOUT_S = 5.0
"""How long the agent at a new address has to answer the registration's challenge."""


class AgentRegistry:
    def __init__(self, store: Store, board: GroupBoard, metrics: JobMetrics, job_token: str):
        self.store = store
        self.job_token = job_token
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
        """Store the group's agent address; one the group does not have yet only once the agent
        there proved it holds the group's token (:meth:`challenge`)."""
        url = normal_url(registration.url)
        if self.urls.get(group) != url:
            self.challenge(group, url)
        agent = _agent(self.store.register_agent(group, url, registration.ranks_per_group, time.time()))
        self._know(agent)
        self.heard_at[group] = agent.renewed
        return agent

    def challenge(self, group: int, url: str) -> None:
        """Ask the agent at ``url`` to prove it holds group ``group``'s token (an UnprovenAgent if
        it does not answer, or answers for another address or token)."""
        nonce = secrets.token_hex(16)
        try:
            response = httpx.get(f"{url}{CHALLENGE_PATH}", params={"nonce": nonce}, timeout=CHALLENGE_TIMEOUT_S)
            response.raise_for_status()
            answer = ChallengeAnswer.model_validate_json(response.content)
        except (httpx.HTTPError, ValidationError) as err:
            raise UnprovenAgent(f"no agent answered group {group}'s registration challenge at {url} "
                                f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); register the "
                                "address this control plane reaches the agent at") from None
        expected = registration_proof(group_token(self.job_token, group), group, url, nonce)
        if normal_url(answer.url) != url or not secrets.compare_digest(answer.proof, expected):
            raise UnprovenAgent(f"the agent at {url} did not prove it holds group {group}'s token; "
                                "its registration is refused and the group keeps its agent")

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
