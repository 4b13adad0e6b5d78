"""Bearer tokens: the job's, the one each agent holds, their strength, and how they are checked.

The job has one token (``ftctl up`` makes one, or ``FTCTL_TOKEN``). Each agent holds only its
group's token, derived from the job's (:func:`group_token`): the control plane can compute it,
so it commands an agent with it and takes that group's events with it, while an agent's token
cannot command another group or post its events. Ranks and the torchft Lighthouse hold none.
No web framework here: the trainer's side imports this module too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Callable, Collection

MIN_TOKEN_LENGTH = 16
KNOWN_TOKENS = frozenset({"change-me", "change-me-local-only", "changeme", "secret", "password", "token", "ftctl"})
"""Placeholders from examples and habits: anyone can guess them, so no service takes them."""

def token_problem(token: str) -> str | None:
    """Why a token is too weak to guard a job (None: it will do)."""
    if token.lower() in KNOWN_TOKENS or token.lower().startswith("change-me"):
        return "the token is a known placeholder"
    if len(token) < MIN_TOKEN_LENGTH:
        return f"the token has {len(token)} characters, fewer than {MIN_TOKEN_LENGTH}"
    return None


def strong_token(token: str) -> str:
    """A settings validator: the token, or one line that says what to do."""
    if (problem := token_problem(token)) is not None:
        raise ValueError(f"{problem}; use a random one (python -c 'import secrets; print(secrets.token_urlsafe(24))')")
    return token


def group_token(job_token: str, group: int) -> str:
    """The token group ``group``'s agent holds: HMAC-SHA256 of the job's token, URL-safe."""
    digest = hmac.new(job_token.encode(), f"ftctl-agent-{group}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


TOKEN_VARIABLES = ("FTCTL_TOKEN", "FTCTL_AGENT_TOKEN", "FT_CP_TOKEN", "FT_AGENT_TOKEN", "FT_LIGHTHOUSE_TOKEN")


def without_tokens(env: dict[str, str]) -> dict[str, str]:
    """An environment for a process that holds no token: a rank, the torchft Lighthouse."""
    return {k: v for k, v in env.items() if k not in TOKEN_VARIABLES}


def new_token() -> str:
    return secrets.token_urlsafe(24)


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header."""
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def token_accepted(presented: str | None, accepted: Collection[str]) -> bool:
    """Compared in constant time with each accepted token."""
    return presented is not None and any(secrets.compare_digest(presented.encode(), t.encode()) for t in accepted)


Accepted = Callable[[str], Collection[str]]
"""The tokens a request to this path may carry."""


def refusal(presented: str | None, accepted: Collection[str]) -> tuple[int, str] | None:
    """The status and one line for a request that may not change anything; None when it may."""
    if not accepted:
        return 403, "this server takes no such request: it was started without a token (--token or FTCTL_TOKEN)"
    if presented is None:
        return 401, ("missing bearer token: send 'Authorization: Bearer <token>' (ftctl up saved it in "
                     "ftstate/connection.json; ftctl reads FTCTL_TOKEN)")
    if not token_accepted(presented, accepted):
        return 403, "wrong bearer token"
    return None
