"""The control plane's client for the agents' HTTP APIs."""

from __future__ import annotations

import httpx
from fastapi import HTTPException


class AgentClient:
    def __init__(self, agents: dict[int, str], token: str):
        self.agents = agents
        self.client = httpx.AsyncClient(timeout=30.0, headers={"Authorization": f"Bearer {token}"})

    async def status(self, group: int) -> dict:
        """The agent's own view: its processes, restarts, warm spare, event buffer."""
        url = self._url(group)
        try:
            response = await self.client.get(f"{url}/status")
            response.raise_for_status()
        except httpx.HTTPError as err:
            raise HTTPException(502, f"the agent of group {group} at {url} does not answer: {err}") from None
        return response.json()

    def _url(self, group: int) -> str:
        url = self.agents.get(group)
        if url is None:
            raise HTTPException(503, f"no agent is registered for group {group}; start it with ftctl up")
        return url

    async def command(self, group: int, action: str) -> dict:
        """POST an action to the group's agent; the agent's 409 stays a 409, silence is a 502."""
        url = self._url(group)
        try:
            response = await self.client.post(f"{url}/{action}")
        except httpx.HTTPError as err:
            raise HTTPException(502, f"the agent of group {group} at {url} does not answer: {err}") from None
        if response.status_code == 409:
            raise HTTPException(409, response.json().get("detail", "conflict"))
        if response.status_code >= 400:
            raise HTTPException(502, f"the agent of group {group} answered {response.status_code}: {response.text[:200]}")
        return response.json()

    async def aclose(self) -> None:
        await self.client.aclose()
