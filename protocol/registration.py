"""How an agent tells the control plane where it is: nothing lists the agents in advance.

An agent ``PUT``\\ s an :class:`AgentRegistration` to :func:`agent_path` with its group's token
(``protocol/tokens.py``): that token can register its own group and no other, so the binding of a
group to its token holds for registration as for events. The control plane keeps the address in
SQLite and answers :class:`RegisteredAgent`. Registering again is harmless (the address is
replaced, ``renewed`` moves); an agent does so every :data:`RENEW_EVERY_S`, and at once when an
ingest answer says the control plane has no address for its group (a control plane that
restarted without its file). A new group number grows the job: the control plane shows and
exports the group from its registration on.
"""

from __future__ import annotations

from pydantic import AnyHttpUrl, BaseModel, Field

from protocol import api
from protocol.events import Count

RENEW_EVERY_S = 30.0
"""An agent registers again this often, so a control plane that lost its store learns it back."""


def agent_path(group: int) -> str:
    """Where group ``group``'s agent registers: its own path, so its token is checked before the body is read."""
    return api.url(api.AGENT, group=group)


def agent_group(path: str) -> int | None:
    """The group a registration path is for (None: no registration path)."""
    tail = path.removeprefix(api.url(api.AGENT, group=""))
    return int(tail) if tail != path and tail.isdigit() and len(tail) < 19 else None


class AgentRegistration(BaseModel):
    url: AnyHttpUrl = Field(description="the agent's HTTP API as the control plane reaches it")
    ranks_per_group: Count | None = Field(None, description="ranks the group runs (informational)")


class RegisteredAgent(BaseModel):
    group: Count
    url: str
    ranks_per_group: Count | None = None
    registered: float = Field(description="Unix time of the group's first registration")
    renewed: float = Field(description="Unix time of its latest")


class AgentList(BaseModel):
    agents: list[RegisteredAgent]
