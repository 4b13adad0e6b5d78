"""Kill and rejoin a group through its agent, and show the result in the hub at once.

The REST endpoints and the drills all go through here. ``sent`` is taken before the command:
a kill lands while the request is still running, and what it causes is timed from then.
"""

from __future__ import annotations

import time

from fastapi import HTTPException

from service.controlplane.agents import AgentClient
from service.controlplane.hub import Hub


async def kill(agents: AgentClient, hub: Hub, group: int, sent: float) -> dict:
    agent = await agents.command(group, "kill")
    hub.force(group, "down", "killed", since=sent)
    return agent


async def rejoin(agents: AgentClient, hub: Hub, group: int, sent: float) -> dict:
    agent = await agents.command(group, "rejoin")
    hub.force(group, "starting", None, since=sent)
    return agent


async def rejoin_unless_restarted(agents: AgentClient, hub: Hub, group: int) -> float | None:
    """Rejoin a killed group and return when; None when its agent has restarted it by itself
    (``ftctl up --auto-rejoin-delay``: the agent answers 409, and its process event says when)."""
    sent = time.time()
    try:
        await rejoin(agents, hub, group, sent)
    except HTTPException as err:
        if err.status_code != 409:
            raise
        return None
    return sent
