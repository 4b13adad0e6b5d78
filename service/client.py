"""How ftctl finds and talks to the control plane."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import httpx
from pydantic import BaseModel, Field

from protocol import api, defaults
from protocol.files import write_private

CONNECTION_FILE = "connection.json"
DEFAULT_STATE_DIR = Path("ftstate")
DEFAULT_API = f"http://{defaults.LOOPBACK}:{defaults.CONTROL_PLANE_PORT}"
REQUEST_TIMEOUT_S = 10.0
"""A control-plane call slower than this failed; every call it serves answers in milliseconds
(a drill's POST returns at once, the drill runs in the background)."""


class ApiError(Exception):
    """One line for the user: what went wrong and what to do; ``status``: the HTTP status the
    control plane answered with (None: it was not reached, or the request was refused here)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


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
        """One request to ``path`` (a full path); its JSON answer, or :class:`ApiError`."""
        with self.client() as c:
            return self.answer(c, method, path, **kwargs)

    def answer(self, c: httpx.Client, method: str, path: str, **kwargs) -> dict | list:
        try:
            response = c.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise ApiError(f"cannot reach the control plane at {self.api} ({err}); is `ftctl up` running? "
                           "Point --api or FTCTL_API at it") from None
        status = response.status_code
        if status in (401, 403):
            raise ApiError(f"{response.json().get('detail')} (set FTCTL_TOKEN or --token)", status)
        if status >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text[:200]
            raise ApiError(f"{method} {path} failed ({status}): {detail}", status)
        return response.json()


class ApiFlags(BaseModel):
    """Where the control plane is: flags, then FTCTL_API / FTCTL_TOKEN, then what `ftctl up` saved."""

    api: str | None = Field(None, description=f"control-plane URL (env FTCTL_API; default: what `ftctl up` saved, "
                            f"else {DEFAULT_API})")
    token: str | None = Field(None, description="bearer token (env FTCTL_TOKEN; default: what `ftctl up` saved)")
    state_dir: Path = Field(DEFAULT_STATE_DIR, description="where `ftctl up` keeps its state")

    def connection(self) -> Connection:
        return Connection.resolve(self.api, self.token, self.state_dir)

    def control_plane(self) -> "ControlPlane":
        return ControlPlane(self.connection())


class ControlPlane:
    """The control plane's REST API, one method per operation (paths: ``protocol/api.py``).

    Answers are the JSON bodies the API documents (``/docs``; the models are
    ``service/controlplane/models.py`` and each drill kind's own); an error status raises
    :class:`ApiError` with the server's one-line detail and the status. One HTTP connection is
    kept open: use it as a context manager, or :meth:`close` it.
    """

    def __init__(self, connection: Connection, timeout: float | None = REQUEST_TIMEOUT_S):
        self.connection = connection
        self.http = connection.client(timeout)

    @classmethod
    def at(cls, url: str, token: str | None = None, timeout: float | None = REQUEST_TIMEOUT_S) -> "ControlPlane":
        return cls(Connection(url.rstrip("/"), token), timeout)

    def __enter__(self) -> "ControlPlane":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, params: dict | None = None, json: dict | None = None, **fields):
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return self.connection.answer(self.http, method, api.url(path, **fields), params=query, json=json)

    # the job
    def quorum(self) -> dict:
        return self._call("GET", api.QUORUM)

    def groups(self) -> list[dict]:
        return self._call("GET", api.GROUPS)

    def group(self, group: int) -> dict:
        """One group, with every transition it went through."""
        return self._call("GET", api.GROUP, group=group)

    def agent_status(self, group: int) -> dict:
        """What the group's agent says of its processes and its warm spare."""
        return self._call("GET", api.GROUP_AGENT, group=group)

    def kill(self, group: int) -> dict:
        return self._call("POST", api.GROUP_KILL, group=group)

    def rejoin(self, group: int) -> dict:
        return self._call("POST", api.GROUP_REJOIN, group=group)

    def evict(self, group: int) -> dict:
        return self._call("POST", api.GROUP_EVICT, group=group)

    def drain(self, group: int, reason: str | None = None) -> dict:
        """Take the group out: it commits its step, leaves, and stays down until a rejoin."""
        return self._call("POST", api.GROUP_DRAIN, group=group, json={"reason": reason})

    def agents(self) -> dict:
        return self._call("GET", api.AGENTS)

    def data(self) -> dict:
        """What the committed steps trained of the job's data: each sample once, twice or skipped."""
        return self._call("GET", api.DATA)

    def goodput(self, **params) -> dict:
        return self._call("GET", api.GOODPUT, params=params)

    def sdc(self) -> dict:
        return self._call("GET", api.SDC)

    def stragglers(self) -> dict:
        return self._call("GET", api.STRAGGLERS)

    # events
    def events(self, group: int | None = None, type: str | list[str] | None = None, since: float | None = None,
               limit: int | None = None, after_id: int | None = None) -> list[dict]:
        """Stored events, oldest first: one page (``limit``) of them."""
        return self.event_page(group, type, since, limit, after_id)["events"]

    def event_page(self, group: int | None = None, type: str | list[str] | None = None, since: float | None = None,
                   limit: int | None = None, after_id: int | None = None) -> dict:
        params = {"group": group, "type": type, "since": since, "limit": limit, "after_id": after_id}
        return self._call("GET", api.EVENTS, params=params)

    def stream_events(self, group: int | None = None, type: str | list[str] | None = None) -> Iterator[dict]:
        """New events as they are stored, until the stream ends (:class:`ApiError`) or the caller stops."""
        params = {k: v for k, v in (("group", group), ("type", type)) if v is not None}
        try:
            with self.connection.client(timeout=None) as c, \
                    c.stream("GET", api.url(api.EVENTS_STREAM), params=params) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        yield json.loads(line[6:])
        except httpx.HTTPError as err:
            raise ApiError(f"the event stream from {self.connection.api} ended: {err}") from None

    # drills
    def start_drill(self, body: dict) -> dict:
        """Start a drill (``{"kind": …, …}``, checked by the control plane); it runs in the background."""
        return self._call("POST", api.DRILLS, json=body)

    def drill(self, drill_id: int) -> dict:
        return self._call("GET", api.DRILL, drill_id=drill_id)

    def drills(self) -> list[dict]:
        return self._call("GET", api.DRILLS)["drills"]

    def drill_kinds(self) -> list[dict]:
        return self._call("GET", api.DRILL_KINDS)

    def cancel_drill(self, drill_id: int) -> dict:
        return self._call("DELETE", api.DRILL, drill_id=drill_id)

    def run_drill(self, body: dict, poll_s: float = 0.5, timeout_s: float | None = None,
                  on_phase: Callable[[dict], None] = lambda drill: None) -> dict:
        """Start a drill and poll it until it is no longer running (``on_phase`` sees each poll);
        the last answer. Past ``timeout_s`` a :class:`TimeoutError`."""
        drill = self.start_drill(body)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while drill["status"] == "running":
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"drill {drill['id']} still running after {timeout_s:.0f}s, in phase "
                                   f"{drill['report']['phase']}")
            time.sleep(poll_s)
            drill = self.drill(drill["id"])
            on_phase(drill)
        return drill
