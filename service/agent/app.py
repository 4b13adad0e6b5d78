"""The agent's HTTP API, used by the control plane: start, kill, stop, rejoin, status."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Literal

from fastapi import Depends, FastAPI, HTTPException, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel

from service.agent.config import AgentSettings
from service.agent.forwarder import EventForwarder
from service.agent.spare import WarmSpare
from service.agent.supervisor import GroupCommand, GroupSupervisor, StateConflict
from service.auth import require_token


class LastExit(BaseModel):
    kind: Literal["killed", "crashed", "stopped", "finished"]
    returncode: int | None
    ts: float


class AgentStatus(BaseModel):
    group: int
    state: Literal["running", "down"]
    pid: int | None
    pids: list[int]
    starts: int
    restarts: int
    last_step: int | None
    last_exit: LastExit | None
    events_buffered: int
    events_dropped: int
    events_forwarded: int
    control_plane_reachable: bool
    spare: Literal["starting", "ready"] | None = None


class CommandResult(BaseModel):
    group: int
    action: str
    pids: list[int] = []
    status: AgentStatus


def create_app(settings: AgentSettings) -> FastAPI:
    trainer_args = [
        "--group", str(settings.group), "--groups", str(settings.groups),
        "--lighthouse", settings.lighthouse, "--events-dir", str(settings.events_dir),
        *(["--advertise-host", settings.advertise_host] if settings.advertise_host else []),
        *settings.trainer_args,
    ]
    forwarder = EventForwarder(settings.group, settings.events_dir, settings.control_plane, settings.token,
                               settings.buffer_capacity, settings.forward_interval_s, settings.forward_batch)

    def on_process_event(action: str, **fields) -> None:
        forwarder.emit_process(action, **fields)

    command = GroupCommand(settings.group, settings.nproc_per_group, trainer_args, settings.advertise_host,
                           settings.log_path)
    spare = WarmSpare(command, settings.run_dir, settings.spare_respawn_delay_s) if settings.spare else None
    supervisor = GroupSupervisor(command, settings.pid_path, on_process_event, settings.stop_timeout_s,
                                 settings.auto_rejoin_delay_s, spare)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.events_dir.mkdir(parents=True, exist_ok=True)
        await run_in_threadpool(supervisor.reap_orphans)
        forwarder.start()
        if settings.autostart:
            supervisor.start()
        yield
        await run_in_threadpool(supervisor.shutdown)
        forwarder.stop()

    app = FastAPI(title=f"ftctl agent for replica group {settings.group}", lifespan=lifespan)
    app.state.supervisor = supervisor
    app.state.forwarder = forwarder
    auth = Depends(require_token(settings.token))

    def status() -> AgentStatus:
        return AgentStatus(
            group=settings.group, state="running" if supervisor.running else "down",
            pid=supervisor.proc.pid if supervisor.running else None, pids=supervisor.pids(),
            starts=supervisor.starts, restarts=supervisor.restarts, last_step=forwarder.last_step,
            last_exit=supervisor.last_exit, events_buffered=len(forwarder.buffer),
            events_dropped=forwarder.dropped, events_forwarded=forwarder.forwarded,
            control_plane_reachable=forwarder.reachable, spare=spare.state() if spare else None,
        )

    async def command(action: str, fn) -> CommandResult:
        try:
            result = await run_in_threadpool(fn)
        except StateConflict as err:
            raise HTTPException(409, str(err)) from None
        pids = result if isinstance(result, list) else ([result] if isinstance(result, int) else [])
        return CommandResult(group=settings.group, action=action, pids=pids, status=status())

    @app.get("/status", response_model=AgentStatus)
    def get_status() -> AgentStatus:
        return status()

    registry = CollectorRegistry()
    labels = {"group": str(settings.group)}
    for name, text, read in (
        ("ftctl_agent_group_running", "1 while the group's torchrun runs", lambda: float(supervisor.running)),
        ("ftctl_agent_spare_ready", "1 while a warm spare is ready to be promoted",
         lambda: float(bool(spare) and spare.state() == "ready")),
        ("ftctl_agent_events_buffered", "events waiting for the control plane", lambda: float(len(forwarder.buffer))),
        ("ftctl_agent_events_dropped", "events dropped because the buffer was full", lambda: float(forwarder.dropped)),
        ("ftctl_agent_events_forwarded", "events delivered to the control plane", lambda: float(forwarder.forwarded)),
        ("ftctl_agent_group_starts", "times the agent started the group", lambda: float(supervisor.starts)),
    ):
        Gauge(name, text, list(labels), registry=registry).labels(**labels).set_function(read)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.post("/start", response_model=CommandResult, dependencies=[auth])
    async def start() -> CommandResult:
        """Start the group's torchrun (409 if it runs)."""
        return await command("start", supervisor.start)

    @app.post("/rejoin", response_model=CommandResult, dependencies=[auth])
    async def rejoin() -> CommandResult:
        """Start a group that is down again; it heals from a live peer (409 if it runs)."""
        return await command("rejoin", supervisor.start)

    @app.post("/kill", response_model=CommandResult, dependencies=[auth])
    async def kill() -> CommandResult:
        """SIGKILL the group's whole process tree (409 if it is down)."""
        return await command("kill", supervisor.kill)

    @app.post("/stop", response_model=CommandResult, dependencies=[auth])
    async def stop() -> CommandResult:
        """Stop the group gracefully (409 if it is down)."""
        return await command("stop", supervisor.stop)

    return app
