"""The wrapper's HTTP API: the Lighthouse's state as JSON, its health, and its metrics."""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, HTTPException, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel

from lighthouse.config import LighthouseSettings
from lighthouse.status import LighthouseStatus, StatusFormatError, parse_status
from lighthouse.supervisor import LighthouseSupervisor


class Health(BaseModel):
    ok: bool
    pid: int | None
    restarts: int
    lighthouse_url: str
    error: str | None = None


def create_app(settings: LighthouseSettings, supervisor: LighthouseSupervisor) -> FastAPI:
    client = httpx.AsyncClient(base_url=settings.local_url, timeout=2.0)
    registry = CollectorRegistry()
    up = Gauge("ftctl_lighthouse_up", "1 when torchft's Lighthouse answers its status page", registry=registry)
    restarts = Counter("ftctl_lighthouse_restarts", "times the wrapper restarted a dead Lighthouse", registry=registry)
    quorum_id = Gauge("ftctl_lighthouse_quorum_id", "current quorum id", registry=registry)
    members = Gauge("ftctl_lighthouse_quorum_participants", "replica groups in the last quorum", registry=registry)
    heartbeating = Gauge("ftctl_lighthouse_heartbeating_replicas", "replica groups heartbeating within the timeout",
                         registry=registry)
    min_replicas = Gauge("ftctl_lighthouse_min_replicas", "configured min_replicas", registry=registry)
    heartbeat_age = Gauge("ftctl_lighthouse_heartbeat_age_seconds", "seconds since a group's last heartbeat",
                          ["group"], registry=registry)
    min_replicas.set(settings.min_replicas)
    counted_restarts = [0]

    async def fetch() -> LighthouseStatus:
        try:
            page = (await client.get("/status")).raise_for_status().text
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

    @app.get("/status", response_model=LighthouseStatus)
    async def status() -> LighthouseStatus:
        """The quorum as the Lighthouse sees it (parsed from its /status page)."""
        return await fetch()

    @app.get("/healthz", response_model=Health, responses={503: {"model": Health}})
    async def healthz(response: Response) -> Health:
        error = None
        try:
            await fetch()
        except HTTPException as err:
            error = err.detail
        health = Health(ok=error is None and supervisor.alive(), pid=supervisor.pid,
                        restarts=supervisor.restarts, lighthouse_url=settings.local_url, error=error)
        if not health.ok:
            response.status_code = 503
        return health

    @app.get("/metrics")
    async def metrics() -> Response:
        restarts.inc(supervisor.restarts - counted_restarts[0])
        counted_restarts[0] = supervisor.restarts
        try:
            state = await fetch()
        except HTTPException:
            up.set(0)
        else:
            up.set(1)
            quorum_id.set(state.quorum_id)
            members.set(len(state.members))
            heartbeating.set(len([h for h in state.heartbeats if not h.stale]))
            heartbeat_age.clear()
            for beat in state.heartbeats:
                if beat.group is not None:
                    heartbeat_age.labels(str(beat.group)).set(beat.age_s)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
