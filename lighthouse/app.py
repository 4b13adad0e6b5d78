"""The wrapper's HTTP API: the Lighthouse's state as JSON, its health, its metrics, and (with the
job's token) a kill for the Lighthouse drill."""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
from fastapi import Depends, FastAPI, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lighthouse.config import LighthouseSettings
from protocol.lighthouse_status import StatusFormatError, parse_status
from lighthouse.supervisor import LighthouseSupervisor
from protocol.auth import require_token
from protocol.http_guard import guard
from protocol.lighthouse import (
    HEALTH_PATH,
    KILL_PATH,
    STATUS_PATH,
    LighthouseHealth,
    LighthouseKill,
    LighthouseKilled,
    LighthouseStatus,
)


class LighthouseCollector:
    """The Lighthouse's metrics, read when Prometheus scrapes: the supervisor's counts and the
    last status page that could be read (kept while the Lighthouse is away; ``up`` says so)."""

    def __init__(self, settings: LighthouseSettings, supervisor: LighthouseSupervisor):
        self.settings = settings
        self.supervisor = supervisor
        self.up = False
        self.status: LighthouseStatus | None = None

    def collect(self):
        s = self.status
        yield GaugeMetricFamily("ftctl_lighthouse_up", "1 when torchft's Lighthouse answers its status page",
                                value=float(self.up))
        yield CounterMetricFamily("ftctl_lighthouse_restarts", "times the wrapper restarted a dead Lighthouse",
                                  value=self.supervisor.restarts)
        yield GaugeMetricFamily("ftctl_lighthouse_min_replicas", "configured min_replicas",
                                value=self.settings.min_replicas)
        if s is None:
            return
        yield GaugeMetricFamily("ftctl_lighthouse_quorum_id", "current quorum id", value=s.quorum_id)
        yield GaugeMetricFamily("ftctl_lighthouse_quorum_participants", "replica groups in the last quorum",
                                value=len(s.members))
        yield GaugeMetricFamily("ftctl_lighthouse_heartbeating_replicas",
                                "replica groups heartbeating within the timeout",
                                value=len([h for h in s.heartbeats if not h.stale]))
        age = GaugeMetricFamily("ftctl_lighthouse_heartbeat_age_seconds", "seconds since a group's last heartbeat",
                                labels=["group"])
        for beat in s.heartbeats:
            if beat.group is not None:
                age.add_metric([str(beat.group)], beat.age_s)
        yield age


def create_app(settings: LighthouseSettings, supervisor: LighthouseSupervisor) -> FastAPI:
    client = httpx.AsyncClient(base_url=settings.local_url, timeout=settings.status_timeout_s)
    collector = LighthouseCollector(settings, supervisor)
    registry = CollectorRegistry()
    registry.register(collector)

    async def fetch() -> LighthouseStatus:
        try:
            page = (await client.get(STATUS_PATH)).raise_for_status().text
        except httpx.HTTPError as err:
            raise HTTPException(503, f"the Lighthouse at {settings.local_url} does not answer: {err}") from None
        try:
            return parse_status(page)
        except StatusFormatError as err:
            raise HTTPException(502, str(err)) from None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Here rather than around uvicorn.run: uvicorn re-raises SIGTERM after its shutdown,
        # so code after run() never runs; the lifespan's exit does.
        supervisor.start()
        yield
        supervisor.stop()
        await client.aclose()

    app = FastAPI(title="torchft Lighthouse wrapper", lifespan=lifespan)
    tokens = [settings.token] if settings.token else []

    def accepted(path: str) -> list[str]:
        return tokens

    guard(app, accepted, [*settings.allowed_hosts, settings.api_host])

    @app.get(STATUS_PATH, response_model=LighthouseStatus, responses={401: {}, 403: {}},
             dependencies=[Depends(require_token(accepted))] if settings.token else [])
    async def status() -> LighthouseStatus:
        """The quorum as the Lighthouse sees it (parsed from its /status page): full replica ids and
        Manager addresses, so with a token set only for its holder (torchft's own page stays open
        on the Lighthouse's port: keep that port on the job's network)."""
        return await fetch()

    @app.get(HEALTH_PATH, response_model=LighthouseHealth, responses={503: {"model": LighthouseHealth}})
    async def healthz(response: Response) -> LighthouseHealth:
        error = None
        try:
            await fetch()
        except HTTPException as err:
            error = err.detail
        health = LighthouseHealth(ok=error is None and supervisor.alive(), pid=supervisor.pid,
                                  restarts=supervisor.restarts, lighthouse_url=settings.local_url, error=error)
        if not health.ok:
            response.status_code = 503
        return health

    @app.post(KILL_PATH, response_model=LighthouseKilled, dependencies=[Depends(require_token(accepted))],
              responses={401: {}, 403: {}, 409: {"description": "the Lighthouse is already down"}})
    async def kill(body: LighthouseKill | None = None) -> LighthouseKilled:
        """SIGKILL the Lighthouse, as a node loss would, and restart it after ``down_s`` (at least
        the restart delay). The groups keep their quorum state; see the README's Lighthouse section."""
        try:
            pid, killed_at, restart_at = supervisor.kill((body or LighthouseKill()).down_s)
        except LookupError as err:
            raise HTTPException(409, str(err)) from None
        return LighthouseKilled(pid=pid, killed_at=killed_at, restart_at=restart_at)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        try:
            collector.status, collector.up = await fetch(), True
        except HTTPException:
            collector.up = False
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
