"""The control plane's FastAPI application: its parts wired together, its routers, its errors."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from protocol import api
from protocol.auth import require_token
from protocol.http_guard import guard
from protocol.ingest import ingest_group
from protocol.registration import agent_group
from protocol.tokens import group_token
from service.controlplane import errors, goodput
from service.controlplane.agents import AgentClient
from service.controlplane.bus import EventBus
from service.controlplane.collector import frozen_survivors, thaw_forever
from service.controlplane.coverage import CoverageLedger
from service.controlplane.db import Store
from service.controlplane.deps import Services
from service.controlplane.drills.context import DrillServices
from service.controlplane.drills.runner import DrillRunner
from service.controlplane.group_control import GroupControl
from service.controlplane.groups import GroupBoard
from service.controlplane.ingest import Ingestor, IngestWriter
from service.controlplane.lighthouse import LighthouseClient
from service.controlplane.liveness import LivenessMonitor
from service.controlplane.metrics import JobMetrics, StateCollector
from service.controlplane.partition_responder import PartitionResponder
from service.controlplane.registry import AgentRegistry
from service.controlplane.retention import prune_forever
from service.controlplane.routers import agents as agents_router
from service.controlplane.routers import data, drills, events, groups, health, quorum, sdc, stragglers
from service.controlplane.routers import goodput as goodput_router
from service.controlplane.settings import ControlPlaneSettings
from service.controlplane.straggler_policy import StragglerResponder
from service.controlplane.stragglers import StragglerTracker


def build_services(settings: ControlPlaneSettings) -> Services:
    store = Store(settings.db)
    store.fail_running_drills("interrupted: the control plane restarted while it ran")
    registered = [row["grp"] for row in store.agents()]
    board = GroupBoard(store, [*range(settings.groups), *registered])
    bus = EventBus(settings.listener_capacity)
    metrics = JobMetrics(board.views)
    registry = AgentRegistry(store, board, metrics, settings.token)
    tracker = StragglerTracker(settings.straggler_window, settings.straggler_factor, settings.straggler_policy,
                               flagged=next((g for g, v in board.views.items() if v.straggler), None))
    agents = AgentClient(registry.urls, settings.token, settings.agent_timeout_s)
    lighthouse = LighthouseClient(settings.lighthouse_api, settings.lighthouse_timeout_s, settings.token)
    state = StateCollector(board, store, metrics, tracker, project=lambda: goodput.projection(
        store, board.median_step_s(), settings.classic_recovery_json, list(goodput.DEFAULT_GPUS),
        goodput.Assumptions()))
    metrics.registry.register(state)
    coverage = CoverageLedger(store)
    ingest = Ingestor(store, board, metrics, bus, tracker, settings.max_clock_skew_s, settings.max_event_age_s,
                      coverage)
    control = GroupControl(agents, board, ingest.record)
    return Services(
        settings=settings, store=store, board=board, bus=bus, ingest=ingest, writer=IngestWriter(ingest),
        agents=agents, registry=registry, control=control, 
        drills=DrillRunner(DrillServices(settings, bus, control, agents, lighthouse, tracker), store),
        lighthouse=lighthouse, stragglers=tracker, coverage=coverage,
        metrics_registry=metrics.registry, metrics_state=state,
    )


def create_app(settings: ControlPlaneSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        services = build_services(settings)
        app.state.services = services
        monitor = LivenessMonitor(services.board, services.agents, services.lighthouse, services.ingest,
                                  settings.liveness_interval_s, settings.lost_after_s, services.registry.heard_at)
        background = [asyncio.create_task(services.writer.run()), asyncio.create_task(monitor.run()),
                      asyncio.create_task(prune_forever(services.store, settings.event_retention_s,
                                                        settings.event_retention_rows)),
                      asyncio.create_task(StragglerResponder(services.bus, services.control).run()),
                      asyncio.create_task(PartitionResponder(services.bus, services.control, services.agents,
                                                             services.ingest).run()),
                      asyncio.create_task(thaw_forever(settings.gc_thaw_every_s))]
        with frozen_survivors():
            yield
        for task in background:
            task.cancel()
        await services.drills.cancel()
        await services.agents.aclose()
        await services.lighthouse.aclose()
        services.store.close()

    app = FastAPI(
        title="ftctl control plane",
        description="Quorum, replica groups, heal events, kill / rejoin and drills of an elastic HSDP job on torchft.",
        version="0.1.0",
        lifespan=lifespan,
    )
    errors.install(app)

    static = Path(__file__).with_name("static")
    app.mount("/static", StaticFiles(directory=static), name="static")

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        """The live page: quorum grid, loss and step-time charts, events, kill / rejoin / drill."""
        return FileResponse(static / "index.html")

    def accepted(path: str) -> list[str]:
        """The job's token; on a group's ingest and registration paths also that group's agent token."""
        group = ingest_group(path)
        if group is None:
            group = agent_group(path)
        return [settings.token] if group is None else [settings.token, group_token(settings.token, group)]

    guard(app, accepted, [*settings.allowed_hosts, settings.host], settings.max_body_bytes)
    auth = [Depends(require_token(accepted))]
    app.include_router(health.router)  # /healthz, /readyz, /metrics: outside the API's prefix
    api_routers = [(agents_router.router, []), (agents_router.mutating, auth), (quorum.router, []),
                   (groups.router, []), (groups.mutating, auth), (events.router, []), (events.ingest_router, auth),
                   (events.stream_router, []),  # a WebSocket: the guard checks its handshake's token
                   (drills.router, []), (drills.mutating, auth),
                   (goodput_router.router, []), (data.router, []), (stragglers.router, []), (sdc.router, [])]
    for router, dependencies in api_routers:
        app.include_router(router, prefix=api.PREFIX, dependencies=dependencies)
    return app
