"""The control plane's client for the agents' HTTP APIs (``protocol/agent.py`` on both sides)."""

from __future__ import annotations

import httpx
from pydantic import BaseModel

from protocol.agent import (CUT_PATH, PROBE_PATH, STATUS_PATH, AgentAction, AgentStatus, CommandResult, CutRequest,
                            CutState, ProbeRequest, ProbeResult, command_path)
from protocol.tokens import group_token
from protocol.injection import INJECT_PATH, InjectRequest, InjectResult
from service.controlplane.errors import AgentConflict, AgentUnreachable, NoAgent


class AgentClient:
    def __init__(self, agents: dict[int, str], job_token: str, timeout_s: float):
        """Each agent is called with its own group's token (``protocol/auth.py``)."""
        self.agents = agents
        self.job_token = job_token
        self.client = httpx.AsyncClient(timeout=timeout_s)

    def _auth(self, group: int) -> dict[str, str]:
        return {"Authorization": f"Bearer {group_token(self.job_token, group)}"}

    def _url(self, group: int) -> str:
        url = self.agents.get(group)
        if url is None:
            raise NoAgent(f"no agent is registered for group {group}; start it with ftctl up")
        return url

    async def status(self, group: int) -> AgentStatus:
        """The agent's own view: its processes, restarts, warm spare, event buffer."""
        url = self._url(group)
        try:
            response = (await self.client.get(f"{url}{STATUS_PATH}", headers=self._auth(group))).raise_for_status()
            return AgentStatus.model_validate(response.json())
        except (httpx.HTTPError, ValueError) as err:
            raise AgentUnreachable(f"the agent of group {group} at {url} does not answer: {err}") from None

    async def command(self, group: int, action: AgentAction, body: BaseModel | None = None) -> CommandResult:
        """POST an action to the group's agent: its 409 is an :class:`AgentConflict`, silence or
        any other error an :class:`AgentUnreachable`."""
        return CommandResult.model_validate(
            await self._post(group, command_path(action), body.model_dump() if body is not None else None))

    async def inject(self, group: int, request: InjectRequest) -> InjectResult:
        """A drill's fault into the group's running ranks (errors as for :meth:`command`)."""
        return InjectResult.model_validate(await self._post(group, INJECT_PATH, request.model_dump()))

    async def probe(self, group: int, request: ProbeRequest) -> ProbeResult:
        """Which other groups' agents the group's host reaches (errors as for :meth:`command`)."""
        return ProbeResult.model_validate(await self._post(group, PROBE_PATH, request.model_dump(mode="json")))

    async def cut(self, group: int, request: CutRequest) -> CutState:
        """The partition drill's cut of the group's host (its 409, nothing cut, an :class:`AgentConflict`)."""
        return CutState.model_validate(await self._post(group, CUT_PATH, request.model_dump()))

    async def mend(self, group: int) -> CutState:
        """Undo the cut of the group's host now."""
        return CutState.model_validate(await self._post(group, CUT_PATH, method="DELETE"))

    async def _post(self, group: int, path: str, body: dict | None = None, method: str = "POST") -> dict:
        url = self._url(group)
        try:
            response = await self.client.request(method, f"{url}{path}", json=body, headers=self._auth(group))
        except httpx.HTTPError as err:
            raise AgentUnreachable(f"the agent of group {group} at {url} does not answer: {err}") from None
        if response.status_code == 409:
            raise AgentConflict(response.json().get("detail", "conflict"))
        if response.status_code >= 400:
            raise AgentUnreachable(f"the agent of group {group} answered {response.status_code}: {response.text[:200]}")
        return response.json()

    async def aclose(self) -> None:
        await self.client.aclose()
