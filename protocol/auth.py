"""The FastAPI dependency that checks a bearer token (``protocol/tokens.py`` holds the rules)."""

from __future__ import annotations

from typing import Callable

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from protocol.tokens import Accepted, refusal

_bearer = HTTPBearer(auto_error=False, description="the token `ftctl up` prints (or FTCTL_TOKEN)")


def require_token(accepted: Accepted) -> Callable:
    """A FastAPI dependency that accepts only ``Authorization: Bearer <token>`` with an accepted
    token (the request guard has already refused the rest; this documents the scheme in OpenAPI)."""

    def check(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        refused = refusal(credentials.credentials if credentials else None, accepted(request.url.path))
        if refused is not None:
            raise HTTPException(refused[0], refused[1], headers={"WWW-Authenticate": "Bearer"})

    return check
