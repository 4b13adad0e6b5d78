"""How an agent tells the control plane where it is: nothing lists the agents in advance.

An agent ``PUT``\\ s an :class:`AgentRegistration` to :func:`agent_path` with its group's token
(``protocol/tokens.py``): that token can register its own group and no other, so the binding of a
group to its token holds for registration as for events. The control plane keeps the address in
SQLite and answers :class:`RegisteredAgent`.

An address the control plane does not hold for the group yet takes effect only once the agent
there has proved it holds the group's token: the control plane ``GET``\ s :data:`CHALLENGE_PATH`
there with a fresh nonce, and the agent answers :class:`ChallengeAnswer`, an HMAC of the nonce
and of its own address under the token (:func:`registration_proof`). The token itself never goes
to an address not yet proven, and an agent signs only its own address: a hostile address that
relays the challenge to a real agent gets a proof of the real agent's address, not of its own.
So a mistyped or hostile ``PUT`` can neither take a group's commands away nor receive them.

Registering again at the same address is harmless and asks nothing (``renewed`` moves); an
agent does so every :data:`RENEW_EVERY_S`, and at once when an ingest answer says the control
plane has no address for its group (a control plane that restarted without its file). A new
group number grows the job: the control plane shows and exports the group from its
registration on.
"""

from __future__ import annotations

import hashlib
import hmac

from pydantic import AnyHttpUrl, BaseModel, Field, TypeAdapter

from protocol import api
from protocol.events import Count

RENEW_EVERY_S = 30.0
"""An agent registers again this often, so a control plane that lost its store learns it back."""
CHALLENGE_PATH = "/challenge"
NONCE_PATTERN = "^[0-9a-f]{32,128}$"


def normal_url(url: str | AnyHttpUrl) -> str:
    """An agent's address as the control plane stores and compares it."""
    return str(TypeAdapter(AnyHttpUrl).validate_python(str(url))).rstrip("/")


def registration_proof(token: str, group: int, url: str, nonce: str) -> str:
    """What proves that the agent at ``url`` holds group ``group``'s token: HMAC-SHA256 under the
    token of the group, the address and the control plane's nonce (hex)."""
    message = f"ftctl agent registration\n{group}\n{normal_url(url)}\n{nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


class ChallengeAnswer(BaseModel):
    url: str = Field(description="the agent's own address, the one it registers")
    proof: str = Field(pattern="^[0-9a-f]{64}$", description="registration_proof(its group's token, group, url, nonce)")

    @classmethod
    def of(cls, token: str, group: int, url: str, nonce: str) -> "ChallengeAnswer":
        """What the agent of ``group`` at ``url``, holding ``token``, answers to ``nonce``."""
        return cls(url=url, proof=registration_proof(token, group, url, nonce))


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
