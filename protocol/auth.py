"""The bearer token every mutating endpoint checks: the control plane's, the agents' and the Lighthouse wrapper's."""

from __future__ import annotations

import secrets
from typing import Callable

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_bearer = HTTPBearer(auto_error=False, description="the token `ftctl up` prints (or FTCTL_TOKEN)")


def require_token(token: str) -> Callable:
    """A FastAPI dependency that accepts only ``Authorization: Bearer <token>``."""

    def check(credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
        if credentials is None:
            raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <token>' "
                                     "(ftctl up printed it; ftctl reads FTCTL_TOKEN)",
                                headers={"WWW-Authenticate": "Bearer"})
        if not secrets.compare_digest(credentials.credentials.encode(), token.encode()):
            raise HTTPException(403, "wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    return check


def new_token() -> str:
    return secrets.token_urlsafe(24)
