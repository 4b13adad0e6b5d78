"""The agent's FastAPI application: its parts built from the settings, its routes, its metrics."""

from __future__ import annotations

from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from service.agent import routes
from service.agent.agent import Agent
from service.agent.config import AgentSettings
from service.agent.metrics import AgentCollector
from service.agent.supervisor import StateConflict
from protocol.auth import require_token
from protocol.http_guard import guard


def create_app(settings: AgentSettings) -> FastAPI:
    agent = Agent.build(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(agent.open)
        yield
        await run_in_threadpool(agent.close)

    app = FastAPI(title=f"ftctl agent for replica group {settings.group}", lifespan=lifespan)
    app.state.agent = agent
    app.state.registry = CollectorRegistry()
    app.state.registry.register(AgentCollector(agent))

    @app.exception_handler(StateConflict)
    async def conflict(request: Request, err: StateConflict) -> JSONResponse:
        return JSONResponse(status_code=409, content={"detail": str(err)})

    accepted = [settings.token]
    guard(app, lambda path: accepted, [*settings.allowed_hosts, settings.host, settings.advertise_host or settings.host,
                                       urlsplit(settings.api_url()).hostname or settings.host])
    app.include_router(routes.router)
    app.include_router(routes.commands, dependencies=[Depends(require_token(lambda path: accepted))])
    return app
