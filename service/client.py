"""How ftctl finds and talks to the control plane."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from protocol import defaults
from protocol.files import write_private

CONNECTION_FILE = "connection.json"
DEFAULT_STATE_DIR = Path("ftstate")
DEFAULT_API = f"http://{defaults.LOOPBACK}:{defaults.CONTROL_PLANE_PORT}"
REQUEST_TIMEOUT_S = 10.0
"""A control-plane call slower than this failed; every call it serves answers in milliseconds
(a drill's POST returns at once, the drill runs in the background)."""


class ApiError(Exception):
    """One line for the user: what went wrong and what to do."""


@dataclass
class Connection:
    api: str
    token: str | None

    @classmethod
    def resolve(cls, api: str | None, token: str | None, state_dir: Path = DEFAULT_STATE_DIR) -> "Connection":
        """Flags first, then FTCTL_API / FTCTL_TOKEN, then the connection file `ftctl up` wrote."""
        saved: dict = {}
        path = state_dir / CONNECTION_FILE
        if path.is_file():
            saved = json.loads(path.read_text())
        return cls(
            api=(api or os.environ.get("FTCTL_API") or saved.get("api") or DEFAULT_API).rstrip("/"),
            token=token or os.environ.get("FTCTL_TOKEN") or saved.get("token"),
        )

    def save(self, state_dir: Path, **extra) -> Path:
        """Write the API address and token (and ``extra``: the other services' addresses)."""
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / CONNECTION_FILE
        write_private(path, json.dumps({"api": self.api, "token": self.token, **extra}))
        return path

    def client(self, timeout: float | None = REQUEST_TIMEOUT_S) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.api, headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kwargs) -> dict | list:
        try:
            with self.client() as c:
                response = c.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise ApiError(f"cannot reach the control plane at {self.api} ({err}); is `ftctl up` running? "
                           "Point --api or FTCTL_API at it") from None
        if response.status_code in (401, 403):
            raise ApiError(f"{response.json().get('detail')} (set FTCTL_TOKEN or --token)")
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text[:200]
            raise ApiError(f"{method} {path} failed ({response.status_code}): {detail}")
        return response.json()
