"""The control plane's FastAPI application."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from service.auth import require_token
from service.controlplane.agents import AgentClient
from service.controlplane.db import Store
from service.controlplane.deps import Services
from service.controlplane.drills import DrillRunner
from service.controlplane.hub import Hub
from service.controlplane.metrics import StateCollector
from service.controlplane.routers import drills, events, goodput, groups, health, quorum
from service.controlplane.settings import ControlPlaneSettings


def create_app(settings: ControlPlaneSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        store = Store(settings.db)
        store.fail_running_drills("interrupted: the control plane restarted while it ran")
        hub = Hub(store, settings.groups)
        agents = AgentClient(settings.agents, settings.token)
        runner = DrillRunner(hub, store, agents, settings.nproc_per_group, settings.drill_timeout_s)
        lighthouse = httpx.AsyncClient(base_url=settings.lighthouse_api, timeout=3.0)
        services = Services(settings, store, hub, agents, runner, lighthouse, hub.metrics.registry)
        hub.metrics.registry.register(StateCollector(
            hub, store, hub.metrics, project=lambda: goodput.project(services, [1024, 16384])))
        app.state.services = services
        yield
        await runner.cancel()
        await agents.aclose()
        await lighthouse.aclose()
        store.close()

    app = FastAPI(
        title="ftctl control plane",
        description="Quorum, replica groups, heal events, kill / rejoin and drills of an elastic HSDP job on torchft.",
        version="0.1.0",
        lifespan=lifespan,
    )

    @app.exception_handler(RequestValidationError)
    async def one_line_422(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return JSONResponse(status_code=422, content={"detail": f"{where}: {first['msg']}", "errors": jsonable_encoder(err.errors())})

    static = Path(__file__).with_name("static")
    app.mount("/static", StaticFiles(directory=static), name="static")

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        """The live page: quorum grid, loss and step-time charts, events, kill / rejoin / drill."""
        return FileResponse(static / "index.html")

    auth = [Depends(require_token(settings.token))]
    app.include_router(health.router)
    app.include_router(quorum.router)
    app.include_router(groups.router)
    app.include_router(groups.mutating, dependencies=auth)
    app.include_router(events.router)
    app.include_router(events.ingest_router, dependencies=auth)
    app.include_router(drills.router)
    app.include_router(drills.mutating, dependencies=auth)
    app.include_router(goodput.router)
    return app

