"""The agent's registration with the control plane (``protocol/registration.py``).

Run from the forwarder's thread, before each round of shipping: register at start, again every
:data:`~protocol.registration.RENEW_EVERY_S`, and at once when the control plane says it has no
address for the group (it restarted without its store). A control plane that is away is asked
again after the forwarder's backoff; a refusal (a 4xx: a wrong token, a group past its
``--max-groups``) is logged once per reason and asked again at the renewal interval.
"""

from __future__ import annotations

import logging
import time

import httpx

from protocol.registration import RENEW_EVERY_S, AgentRegistration, RegisteredAgent, agent_path

log = logging.getLogger("agent.registrar")


class Registrar:
    def __init__(self, group: int, control_plane: str, registration: AgentRegistration,
                 retry_s: float, renew_s: float = RENEW_EVERY_S):
        self.group = group
        self.url = f"{control_plane}{agent_path(group)}"
        self.registration = registration
        self.retry_s = retry_s
        self.renew_s = renew_s
        self.registered: RegisteredAgent | None = None
        self._due = 0.0
        self._last_problem = ""

    def forget(self) -> None:
        """The control plane no longer knows us: register at the next round."""
        self._due = 0.0

    def tick(self, client: httpx.Client) -> None:
        """Register if it is due; never raises."""
        now = time.monotonic()
        if now < self._due:
            return
        try:
            response = client.put(self.url, json=self.registration.model_dump(mode="json"))
            if response.status_code < 300:
                first = self.registered is None
                self.registered = RegisteredAgent.model_validate(response.json())
                if first or self._last_problem:
                    log.info("registered group %d at %s with the control plane", self.group, self.registered.url)
                self._last_problem, self._due = "", now + self.renew_s
                return
            problem = f"{response.status_code} {response.text[:200]}"
            self._due = now + (self.retry_s if response.status_code >= 500 else self.renew_s)
        except (httpx.HTTPError, ValueError) as err:
            problem, self._due = str(err) or type(err).__name__, now + self.retry_s
        if problem != self._last_problem:
            log.warning("cannot register group %d with the control plane (%s); asking again", self.group, problem)
            self._last_problem = problem
