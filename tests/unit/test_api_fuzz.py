"""The control plane's OpenAPI document is its contract: Schemathesis generates requests from it
(valid and invalid, with and without the token) against a real control-plane process, and every
answer must be no server error, a documented status and content type, and a body that validates
against the schema the document declares for it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit
from typing import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from api_checks import no_unhandled_error
from cluster import REPO, wait_for
from processes import Owner
from protocol.torchrun import free_port
from service.controlplane.app import create_app
from service.controlplane.db import Store
from service.controlplane.settings import ControlPlaneSettings

TOKEN = "fuzz-token-0123456789abcdef"


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """Two groups, their agents (registered earlier: in the control plane's file) and the
    Lighthouse wrapper at addresses nothing answers: every path that would reach them must answer
    a documented 502 or 503. No group past those two may join (``--max-groups``). Yields the
    control plane's URL and that address."""
    tmp = tmp_path_factory.mktemp("fuzz")
    port, nowhere = free_port(), f"http://127.0.0.1:{free_port()}"
    store = Store(tmp / "control.db")
    for g in (0, 1):
        store.register_agent(g, nowhere, None, time.time())
    store.close()
    with Owner() as owner, open(tmp / "controlplane.log", "wb") as log:
        subprocess.Popen([sys.executable, "-m", "service.controlplane", "--port", str(port), "--groups", "2",
                          "--db", str(tmp / "control.db"), "--lighthouse-api", nowhere,
                          "--agent-timeout-s", "2", "--max-groups", "2",
                          "--lighthouse-timeout-s", "1"],
                         cwd=REPO, env=owner.env(FTCTL_TOKEN=TOKEN), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(url), 30, "the control plane")
        yield url, nowhere


def challenged_on_loopback_only(case) -> bool:
    """A registration the control plane accepts for checking makes it challenge the address
    (``protocol/registration.py``): only loopback addresses are fuzzed that far here (nothing
    answers there: a 403); any other address is left out, for this machine reaches no other."""
    if case.operation.label != REGISTER or not isinstance(case.body, dict):
        return True
    group, url = (case.path_parameters or {}).get("group"), case.body.get("url")
    if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < 2 or not isinstance(url, str):
        return True  # refused before any call: 409 past --max-groups, or 422
    try:
        return urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")
    except ValueError:
        return True


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _operations() -> list:
    """The operations of the document the control plane serves (built here without starting it)."""
    document = create_app(ControlPlaneSettings(token=TOKEN, db=Path("unused.db"), groups=2)).openapi()
    operations = [result.ok() for result in schemathesis.openapi.from_dict(document).get_all_operations()]
    return [op for op in operations if op.label != ENDLESS]


REGISTER = "PUT /api/v1/agents/{group}"
ENDLESS = "GET /api/v1/events/stream"
"""An endless stream: each call would run until its timeout (tests/test_service_e2e.py reads it)."""
OPERATIONS = _operations()


def _fuzz(operation, base_url: str, examples: int, headers: dict[str, str]) -> None:
    @given(case=operation.as_strategy().filter(challenged_on_loopback_only))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case) -> None:
        case.call_and_validate(base_url=base_url, headers=headers, timeout=30,
                               excluded_checks=[schemathesis.checks.not_a_server_error],
                               additional_checks=[no_unhandled_error])

    run()


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_every_answer_is_documented_valid_and_never_a_server_error(control_plane, operation):
    url, nowhere = control_plane
    _fuzz(operation, url, 25, {"Authorization": f"Bearer {TOKEN}"})
    if operation.label == REGISTER:  # no registration it sent took effect: nothing answered a challenge
        assert {a["url"] for a in httpx.get(f"{url}/api/v1/agents").json()["agents"]} == {nowhere}


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_without_the_token_every_answer_is_documented_too(control_plane, operation):
    _fuzz(operation, control_plane[0], 5, {})
