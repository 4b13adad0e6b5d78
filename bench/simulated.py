"""Simulated replica groups: many in one process, each a group's rank 0 without a model.

    FTCTL_TOKEN=... python -m bench.simulated --groups 0-127 --lighthouse http://127.0.0.1:29510 \\
        --control-plane http://127.0.0.1:8000 --state-dir /tmp/sim [--step-s 0.2] [--port 0]

What grows with the number of groups is measured with these: the torchft Lighthouse, the agents'
path into the control plane, SQLite, the metrics, the API and the page. Each group talks to the
real Lighthouse as a group's rank 0 does, through torchft's own client: a heartbeat every
``--heartbeat-s`` (torchft's Manager: 100 ms) and a quorum request per step, then "computes"
for ``--step-s`` (a step lasts the quorum's wait plus that). A group behind the quorum's newest step heals (its step jumps there).
It writes the real event stream (start, quorum, heal, step, exit) through the trainer's event
sink, and the real agent forwarder ships it to the control plane, where each group registers
itself. One HTTP server answers the agent API for every group at ``/g/{group}``: the control
plane's kill, rejoin, liveness checks and partition probes reach it as they reach a real agent. A killed group
stops heartbeating and asking at once, as a SIGKILLed one does; its request in flight is left
to the Lighthouse.

``GET /stats`` answers what the groups saw since the last ``POST /stats/reset``: every quorum
request's latency, failed requests, and for each kill the time until one of this process's
groups received a quorum without the killed replica.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import get_args
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException
from pydantic import BaseModel
from torchft._torchft import LighthouseClient

from protocol.agent import (HEALTH_PATH, PROBE_PATH, STATUS_PATH, AgentAction, AgentStatus, CommandResult, LastExit,
                            ProbeRequest, ProbeResult, command_path)
from protocol.auth import require_token
from protocol.events import ExitEvent, HealEvent, QuorumEvent, StartEvent, StepEvent
from protocol.health import Served
from protocol.registration import CHALLENGE_PATH, AgentRegistration, ChallengeAnswer
from protocol.replicas import group_of, replica_name
from protocol.tokens import group_token, strong_token
from protocol.torchrun import free_port
from service.agent.forwarder import EventForwarder
from service.agent.probe import probe as probe_peers
from service.client import ApiError, ControlPlane
from service.proctree import end_tree
from bench.events import start_fields, step_fields
from trainer.telemetry import EventSink

log = logging.getLogger("simulated")
GROUP_PREFIX = "/g/{group}"
REPO = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 30.0


def parse_groups(text: str) -> list[int]:
    """``0-3,8`` → [0, 1, 2, 3, 8]."""
    groups: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        groups += range(int(first), int(last or first) + 1)
    return sorted(set(groups))


class Stats(BaseModel):
    quorum_s: list[float] = []
    quorum_failures: int = 0
    kill_to_reduced_quorum_s: list[float] = []
    steps: int = 0


@dataclass
class _Kill:
    replica_id: str
    at: float


@dataclass
class Recorder:
    """What this process's groups saw; every thread writes under one lock (a few per step)."""

    stats: Stats = field(default_factory=Stats)
    pending_kills: list[_Kill] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def quorum(self, seconds: float, members: set[str]) -> None:
        now = time.monotonic()
        with self.lock:
            self.stats.quorum_s.append(seconds)
            for kill in [k for k in self.pending_kills if k.replica_id not in members]:
                self.stats.kill_to_reduced_quorum_s.append(now - kill.at)
                self.pending_kills.remove(kill)

    def failed(self) -> None:
        with self.lock:
            self.stats.quorum_failures += 1

    def stepped(self) -> None:
        with self.lock:
            self.stats.steps += 1

    def killed(self, replica_id: str) -> None:
        with self.lock:
            self.pending_kills.append(_Kill(replica_id, time.monotonic()))

    def take(self, reset: bool) -> Stats:
        with self.lock:
            out = self.stats.model_copy(deep=True)
            if reset:
                self.stats = Stats()
            return out


@dataclass
class HostConfig:
    lighthouse: str
    control_plane: str
    job_token: str
    events_dir: Path
    url: str
    step_s: float
    heartbeat_s: float
    quorum_timeout_s: float
    forward_interval_s: float


class Conflict(Exception):
    pass


class SimGroup:
    """One simulated group: its quorum loop (a thread per start) and its agent's forwarder."""

    def __init__(self, group: int, cfg: HostConfig, recorder: Recorder):
        self.group = group
        self.cfg = cfg
        self.recorder = recorder
        self.replica_id: str | None = None
        self.step = 0
        self.starts = 0
        self.last_exit: LastExit | None = None
        self._stop = threading.Event()
        self._client = LighthouseClient(cfg.lighthouse, timedelta(seconds=5))
        self.forwarder = EventForwarder(
            group, cfg.events_dir, cfg.control_plane, group_token(cfg.job_token, group), capacity=20_000,
            interval_s=cfg.forward_interval_s, batch=500, timeout_s=5.0,
            registration=AgentRegistration(url=f"{cfg.url}/g/{group}", ranks_per_group=1))

    @property
    def running(self) -> bool:
        return self.replica_id is not None

    def start(self) -> None:
        if self.running:
            raise Conflict(f"group {self.group} runs")
        self.replica_id = f"{replica_name(self.group)}:{uuid.uuid4()}"
        self._stop = threading.Event()
        self.starts += 1
        self.forwarder.emit_process("started", pid=os.getpid())
        threading.Thread(target=self._run, args=(self.replica_id, self._stop), name=f"sim-{self.group}",
                         daemon=True).start()

    def end(self, kind: str) -> None:
        """``killed``/``evicted``: at once, nothing more from the group; ``drained``: it says so first."""
        if not self.running:
            raise Conflict(f"group {self.group} is down")
        replica_id, self.replica_id = self.replica_id, None
        self.last_exit = LastExit(kind=kind, returncode=-signal.SIGKILL if kind != "drained" else 0, ts=time.time())
        self._stop.set()
        if kind != "drained":
            self.recorder.killed(replica_id)
        self.forwarder.emit_process(kind, pid=os.getpid(), returncode=self.last_exit.returncode)

    def heartbeat(self, client: LighthouseClient) -> None:
        replica_id = self.replica_id
        if replica_id is not None:
            try:
                client.heartbeat(replica_id, timedelta(seconds=1))
            except Exception:  # the Lighthouse away: its quorum requests fail and say so
                pass

    def _run(self, replica_id: str, stop: threading.Event) -> None:
        sink = EventSink(self.cfg.events_dir, self.group, 0)
        sink.emit(StartEvent, **start_fields(pid=os.getpid(), replica_id=replica_id, device="simulated",
                                             config="simulated", model="simulated"))
        previous = -1
        while not stop.is_set():
            began = time.monotonic()
            try:
                quorum = self._client.quorum(replica_id=replica_id, timeout=timedelta(seconds=self.cfg.quorum_timeout_s),
                                             address=self.cfg.url, store_address=f"{self.cfg.url}/g/{self.group}",
                                             step=self.step,
                                             world_size=1, shrink_only=False)
            except Exception as err:  # a timeout, the Lighthouse away: counted, asked again
                if not stop.is_set():
                    self.recorder.failed()
                    log.warning("group %d: no quorum: %s", self.group, err)
                    stop.wait(min(1.0, self.cfg.step_s))
                continue
            waited = time.monotonic() - began
            if stop.is_set():
                break  # killed while it waited: a dead group reports nothing
            members = {m.replica_id: m.step for m in quorum.participants}
            self.recorder.quorum(waited, set(members))
            quorum_id = int(quorum.quorum_id)
            if quorum_id != previous:
                sink.emit(QuorumEvent, quorum_id=quorum_id, previous_quorum_id=previous, step=self.step,
                          participants=len(members))
                previous = quorum_id
            newest = max(members.values())
            healed = self.step < newest
            if healed:
                source = next(r for r, s in members.items() if s == newest)
                sink.emit(HealEvent, step=newest, source_group=group_of(source) or 0, bytes=0, fetch_s=0.0, load_s=0.0)
                self.step = newest
            stop.wait(self.cfg.step_s)  # compute: the quorum comes first, as torchft's allreduce waits for it
            if stop.is_set():
                break
            self.step += 1
            self.recorder.stepped()
            sink.emit(StepEvent, **step_fields(
                self.step, len(members), loss=1.0 / self.step, step_s=time.monotonic() - began,
                compute_s=self.cfg.step_s, allreduce_s=waited, commit_s=0.0, quorum_id=quorum_id,
                participating=not healed, healed=healed, batches_committed=self.step))
        if self.last_exit is not None and self.last_exit.kind == "drained":
            sink.emit(ExitEvent, reason="stopped", step=self.step)
        sink.close()

    def status(self) -> AgentStatus:
        f = self.forwarder
        pid = os.getpid() if self.running else None
        return AgentStatus(group=self.group, state="running" if self.running else "down", pid=pid,
                           pids=[pid] if pid else [], starts=self.starts, restarts=max(0, self.starts - 1),
                           last_step=f.last_step, last_exit=self.last_exit, events_buffered=len(f.buffer),
                           events_dropped=f.dropped, events_refused=f.refused, events_invalid=f.invalid,
                           events_forwarded=f.forwarded, control_plane_reachable=f.reachable)


class Host:
    """Every simulated group of this process, their heartbeats and their agent API."""

    def __init__(self, groups: list[int], cfg: HostConfig):
        self.cfg = cfg
        self.recorder = Recorder()
        self.groups = {g: SimGroup(g, cfg, self.recorder) for g in groups}
        self._beating = threading.Event()
        self._beat_client = LighthouseClient(cfg.lighthouse, timedelta(seconds=5))

    def open(self) -> None:
        self.cfg.events_dir.mkdir(parents=True, exist_ok=True)
        for group in self.groups.values():
            group.forwarder.start()
            group.start()
        threading.Thread(target=self._heartbeats, name="sim-heartbeats", daemon=True).start()

    def close(self) -> None:
        self._beating.set()
        for group in self.groups.values():
            if group.running:
                group.end("drained")
        for group in self.groups.values():
            group.forwarder.stop()

    def _heartbeats(self) -> None:
        while not self._beating.wait(self.cfg.heartbeat_s):
            for group in list(self.groups.values()):
                group.heartbeat(self._beat_client)

    def group(self, group: int) -> SimGroup:
        if group not in self.groups:
            raise HTTPException(404, f"no simulated group {group} here")
        return self.groups[group]

    def act(self, group: int, action: AgentAction) -> CommandResult:
        sim = self.group(group)
        already = False
        try:
            if action in ("start", "rejoin"):
                sim.start()
            else:
                sim.end({"kill": "killed", "evict": "evicted", "drain": "drained"}[action])
        except Conflict as err:
            if action != "rejoin":
                raise HTTPException(409, str(err)) from None
            already = True
        pids = [os.getpid()] if sim.running else []
        return CommandResult(group=group, action=action, pids=pids, already_running=already, status=sim.status())


def create_app(host: Host) -> FastAPI:
    def accepted(path: str) -> list[str]:
        parts = path.split("/")
        return [group_token(host.cfg.job_token, int(parts[2]))] if len(parts) > 2 and parts[2].isdigit() else []

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        host.open()
        yield
        host.close()

    app = FastAPI(title="simulated replica groups", lifespan=lifespan)
    per_group = APIRouter(prefix=GROUP_PREFIX)
    commands = APIRouter(prefix=GROUP_PREFIX, dependencies=[Depends(require_token(accepted))])

    @per_group.get(STATUS_PATH, response_model=AgentStatus)
    def status(group: int) -> AgentStatus:
        return host.group(group).status()

    @per_group.get(HEALTH_PATH, response_model=Served)
    def healthz(group: int) -> Served:
        host.group(group)
        return Served(ok=True)

    @per_group.get(CHALLENGE_PATH, response_model=ChallengeAnswer)
    def challenge(group: int, nonce: str) -> ChallengeAnswer:
        """As an agent proves its registration (``protocol/registration.py``)."""
        host.group(group)
        return ChallengeAnswer.of(group_token(host.cfg.job_token, group), group,
                                  f"{host.cfg.url}{GROUP_PREFIX.format(group=group)}", nonce)

    def command(action: AgentAction):
        def run(group: int) -> CommandResult:
            return host.act(group, action)
        return run

    for action in get_args(AgentAction):
        commands.add_api_route(command_path(action), command(action), methods=["POST"], response_model=CommandResult)

    @commands.post(PROBE_PATH, response_model=ProbeResult)
    async def probe(group: int, body: ProbeRequest) -> ProbeResult:
        """The partition responder's question: the groups served here share this host and reach
        each other (the question came in); others are probed as an agent probes them."""
        host.group(group)
        here = urlsplit(host.cfg.url).netloc
        elsewhere = ProbeRequest(peers={g: u for g, u in body.peers.items() if urlsplit(str(u)).netloc != here},
                                 timeout_s=body.timeout_s)
        probed = (await probe_peers(group, elsewhere)).reached if elsewhere.peers else {}
        return ProbeResult(group=group, reached={g: probed.get(g, True) for g in body.peers})

    @app.get("/stats", response_model=Stats)
    def stats(reset: bool = False) -> Stats:
        return host.recorder.take(reset)

    app.include_router(per_group)
    app.include_router(commands)
    return app


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=parse_groups, required=True, help="group numbers: 0-127 or 0,5,9")
    parser.add_argument("--lighthouse", required=True, help="torchft Lighthouse address (http://host:port)")
    parser.add_argument("--control-plane", required=True)
    parser.add_argument("--state-dir", type=Path, required=True, help="events/ go here")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--step-s", type=float, default=0.2)
    parser.add_argument("--heartbeat-s", type=float, default=0.1, help="torchft's Manager heartbeats every 100 ms")
    parser.add_argument("--quorum-timeout-s", type=float, default=60.0)
    parser.add_argument("--forward-interval-s", type=float, default=0.5)
    args = parser.parse_args()
    token = os.environ.get("FTCTL_TOKEN")
    if not token:
        parser.error("set FTCTL_TOKEN to the job's token")
    strong_token(token)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s simulated %(message)s")
    faulthandler.enable()  # a crash in torchft's client under hundreds of threads leaves its trace in the log
    listener = socket.create_server((args.host, args.port))
    url = f"http://{args.host}:{listener.getsockname()[1]}"
    host = Host(args.groups, HostConfig(args.lighthouse, args.control_plane, token, args.state_dir / "events", url,
                                        args.step_s, args.heartbeat_s, args.quorum_timeout_s, args.forward_interval_s))
    print(f"simulating groups {args.groups[0]}..{args.groups[-1]} ({len(args.groups)}) at {url}", flush=True)
    uvicorn.Server(uvicorn.Config(create_app(host), log_level="warning")).run(sockets=[listener])
    return 0



@dataclass
class SimShape:
    """A simulated job: how many groups, over how many processes, how fast, how it is watched."""

    groups: int
    hosts: int = 2
    """processes the groups are spread over; 0: none (bench.ingest brings its own load)"""
    step_s: float = 0.2
    heartbeat_timeout_ms: int = 1000
    join_timeout_ms: int = 1000
    heartbeat_s: float = 0.1
    forward_interval_s: float = 0.5


class SimJob:
    """The real Lighthouse (its wrapper), the real control plane, and ``shape.hosts`` processes
    of simulated groups sharing ``shape.groups`` between them; on free ports, stopped by pid tree.

    A context manager: leaving it ends every process it started, however the block ended."""

    def __init__(self, state_dir: Path, shape: SimShape, token: str, control_plane_args: list[str] = ()):
        self.state_dir = state_dir
        self.shape = shape
        self.groups = shape.groups
        self.token = token
        self.control_plane_args = list(control_plane_args)
        self.lighthouse = f"http://127.0.0.1:{free_port()}"
        self.api_url = f"http://127.0.0.1:{free_port()}"
        self.lighthouse_api = f"http://127.0.0.1:{free_port()}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.host_urls: list[str] = []
        self.control = ControlPlane.at(self.api_url, token, timeout=30)
        self.api = httpx.Client(base_url=self.api_url, timeout=30, headers={"Authorization": f"Bearer {token}"})
        """Raw requests with the job's token: ``/metrics``, and what a test checks of the HTTP contract."""

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "logs" / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "FTCTL_TOKEN": self.token, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"},
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def wait_http(self, name: str, url: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode} "
                                   f"(log: {self.state_dir / 'logs' / f'{name}.log'})")
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{name} did not answer {url} within {timeout_s:.0f}s")

    def start_control_plane(self, db: str = "control.db") -> None:
        """The control plane on its port (again, after :meth:`end`), with the SQLite file ``db``."""
        self.spawn("controlplane", ["-m", "service.controlplane", "--port", self.api_url.rsplit(":", 1)[1],
                                     "--db", str(self.state_dir / db), "--groups", "0", "--ranks-per-group", "1",
                                     "--lighthouse-api", self.lighthouse_api, *self.control_plane_args])
        self.wait_http("controlplane", f"{self.api_url}/healthz")

    def __enter__(self) -> "SimJob":
        shape = self.shape
        try:
            self.spawn("lighthouse", ["-m", "lighthouse", "--bind", self.lighthouse.removeprefix("http://"),
                                       "--min-replicas", "1", "--heartbeat-timeout-ms", str(shape.heartbeat_timeout_ms),
                                       "--join-timeout-ms", str(shape.join_timeout_ms),
                                       "--api-port", self.lighthouse_api.rsplit(":", 1)[1]])
            self.wait_http("lighthouse", f"{self.lighthouse_api}/healthz")
            self.start_control_plane()
            per_host = -(-self.groups // max(1, shape.hosts))
            for h in range(shape.hosts):
                first, last = h * per_host, min(self.groups, (h + 1) * per_host) - 1
                if first > last:
                    break
                port = free_port()
                self.spawn(f"sim{h}", ["-m", "bench.simulated", "--groups", f"{first}-{last}", "--lighthouse",
                                        self.lighthouse, "--control-plane", self.api_url, "--state-dir",
                                        str(self.state_dir), "--port", str(port), "--step-s", str(shape.step_s),
                                        "--heartbeat-s", str(shape.heartbeat_s),
                                        "--forward-interval-s", str(shape.forward_interval_s)])
                self.host_urls.append(f"http://127.0.0.1:{port}")
            for h, url in enumerate(self.host_urls):
                self.wait_http(f"sim{h}", f"{url}/stats")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def groups_view(self) -> list[dict]:
        return self.control.groups()

    def wait_training(self, timeout_s: float = 120) -> float:
        """Until every group trains; returns how long that took."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            try:
                views = self.groups_view()
                if len(views) == self.groups and all(v["state"] == "training" for v in views):
                    return time.monotonic() - began
            except (ApiError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the {self.groups} simulated groups did not all train within {timeout_s:.0f}s")

    def stats(self, reset: bool = False) -> Stats:
        """Every host's stats, pooled."""
        pooled = Stats()
        for url in self.host_urls:
            part = Stats.model_validate(httpx.get(f"{url}/stats", params={"reset": reset}, timeout=30).json())
            pooled.quorum_s += part.quorum_s
            pooled.kill_to_reduced_quorum_s += part.kill_to_reduced_quorum_s
            pooled.quorum_failures += part.quorum_failures
            pooled.steps += part.steps
        return pooled

    def end(self, name: str) -> None:
        """End one of the processes (its whole tree) and forget it."""
        proc = self.procs.pop(name)
        end_tree(proc, STOP_GRACE_S)

    def stop(self) -> None:
        for name in sorted(self.procs, key=lambda n: {"lighthouse": 2, "controlplane": 1}.get(n, 0)):
            end_tree(self.procs[name], STOP_GRACE_S)
        self.procs.clear()
        self.control.close()
        self.api.close()


if __name__ == "__main__":
    raise SystemExit(main())
