"""`ftctl up`: starts the Lighthouse wrapper, the control plane and N agents, and stops them.

Every child runs in a session of its own so a Ctrl-C in the terminal reaches only ftctl,
which then stops them in order: agents first (each stops its group gracefully), then the
control plane, then the Lighthouse; whatever is left is killed by pid, tree by tree. Should
ftctl itself die without that (SIGKILL, a closed terminal), the kernel sends each child SIGTERM
(``PR_SET_PDEATHSIG``), and each stops what it runs. A lock on the state folder keeps a second
`ftctl up` out of it, and every service must answer its health check from the very process just
started: a server left on the port by another job is not taken for ours.

Each child gets only the token it needs: the control plane and the Lighthouse wrapper the job's,
each agent its group's (``protocol/tokens.py``); the ranks and the torchft Lighthouse none.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import httpx
from pydantic import Field

from protocol import defaults
from protocol.job import JobSettings
from protocol.agent import HEALTH_PATH as AGENT_HEALTH_PATH
from protocol import api
from protocol.registration import AgentList
from protocol.lifetime import die_with_parent
from protocol.lighthouse import HEALTH_PATH as LIGHTHOUSE_HEALTH_PATH
from protocol.tokens import TOKEN_VARIABLES, group_token
from protocol.torchrun import free_port, torchrun_env
from service.agent.restarts import RestartSettings
from service.client import DEFAULT_STATE_DIR, Connection
from service.proctree import REAPED_S, end_tree, wait_gone

POLL_S = 0.1
"""How often a starting service is asked whether it answers yet."""
PROBE_TIMEOUT_S = 1.0
"""A health probe slower than this counts as not answering yet."""
LOCK_FILE = "ftctl-up.lock"


class StateLock:
    """An exclusive lock on a state folder for as long as this process lives (the kernel drops it
    with the process); the folder is made private (0700): it holds the token."""

    def __init__(self, state_dir: Path):
        state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o700)
        self.path = state_dir / LOCK_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise StartupError(f"another ftctl up (pid {holder}) runs on {state_dir}/; stop it first, or pass "
                               "--state-dir for a second job") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        os.close(self._fd)


class UpSettings(RestartSettings, JobSettings):
    """Start the Lighthouse, the control plane and N replica groups, and watch them (the job checked first)."""

    groups: int = Field(2, ge=1, description="replica groups N")
    ranks_per_group: int = Field(defaults.RANKS_PER_GROUP, ge=1, description="ranks per group K")
    steps: int = Field(2000, ge=1, description="train until this step")
    port: int = Field(defaults.CONTROL_PLANE_PORT, ge=0, le=65535, description="control-plane port")
    host: str = Field(defaults.LOOPBACK, description="control-plane bind address (loopback unless told otherwise)")
    state_dir: Path = Field(DEFAULT_STATE_DIR, description="events, logs, checkpoints, SQLite and the connection file")
    lighthouse_port: int = Field(defaults.LIGHTHOUSE_PORT, ge=1, le=65535, description="torchft Lighthouse port")
    min_replicas: int = Field(1, ge=1, description="fewest groups that may commit a step")
    heartbeat_timeout_ms: int = Field(defaults.HEARTBEAT_TIMEOUT_MS, ge=50, description="Lighthouse failure detection")
    join_timeout_ms: int = Field(
        defaults.JOIN_TIMEOUT_MS, ge=0,
        description="how long a new quorum waits for groups that have not asked to join; shorter lets a "
        "promoted spare in before the dead group's heartbeat times out")
    spares: int = Field(0, ge=0, description="keep a warm spare for the first S groups: rejoin promotes it "
                        "instead of starting cold")
    zygote: bool = Field(True, description="each agent forks its group's ranks from a process that imported "
                         "everything once (--no-zygote: every start is a cold torchrun start)")
    straggler_policy: Literal["flag", "evict"] = Field(
        "flag", description="flag: show a persistent straggler; evict: also end it when keeping it costs more of the "
        "throughput than losing it (a warm spare takes its place)")
    straggler_factor: float = Field(1.15, gt=1, description="a group computing this much longer than its peers' "
                                    "median, and waiting least, is a straggler")
    sdc_check: bool = Field(True, description="check every group's gradient norm before gradients cross groups "
                            "(--no-sdc-check: average at once, as plain HSDP does)")
    trainer_arg: list[str] = Field(default_factory=list, description="extra trainer flag, repeatable: "
                                   "--trainer-arg=--fingerprint-every=5 (python -m trainer --help lists them)")
    refresh: float = Field(1.0, gt=0, description="seconds between live-view refreshes")
    startup_timeout_s: float = Field(60.0, gt=0, description="a service that does not answer within this failed to start")
    stop_timeout_s: float = Field(40.0, gt=0, description="on Ctrl-C, each service gets this long to stop its "
                                  "own children before its tree is killed")

    @property
    def api(self) -> str:
        host = defaults.LOOPBACK if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen
    log: Path
    restarts: int = 0


class StartupError(Exception):
    pass


class LocalJob:
    """The processes of one job on this machine, as `ftctl up` starts, revives and stops them."""

    def __init__(self, cfg: UpSettings, token: str):
        self.cfg = cfg
        self.token = token
        self.children: list[Child] = []
        self.lighthouse_api_port = free_port()
        self.agent_ports = {g: free_port() for g in range(cfg.groups)}

    @property
    def bind_host(self) -> str:
        """Loopback unless the control plane was told to listen beyond it."""
        return defaults.LOOPBACK if self.cfg.host in (defaults.LOOPBACK, "localhost") else "[::]"

    @property
    def lighthouse_url(self) -> str:
        return defaults.lighthouse_address(port=self.cfg.lighthouse_port)

    @property
    def lighthouse_api(self) -> str:
        return f"http://{defaults.LOOPBACK}:{self.lighthouse_api_port}"

    def agent_url(self, group: int) -> str:
        return f"http://{defaults.LOOPBACK}:{self.agent_ports[group]}"

    def _env(self, name: str) -> dict[str, str]:
        """The job's token for the control plane and the Lighthouse wrapper, its group's for an agent."""
        env = {k: v for k, v in os.environ.items() if k not in TOKEN_VARIABLES}
        if name.startswith("agent"):
            return {**env, "FTCTL_AGENT_TOKEN": group_token(self.token, int(name.removeprefix("agent")))}
        return {**env, "FTCTL_TOKEN": self.token}

    def _popen(self, name: str, argv: list[str], log: Path) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=self._env(name), preexec_fn=die_with_parent)

    def _spawn(self, name: str, argv: list[str]) -> Child:
        log = self.cfg.state_dir / "logs" / f"{name}.log"
        child = Child(name, argv, self._popen(name, argv, log), log)
        self.children.append(child)
        return child

    def revive(self) -> list[str]:
        """Restart any service process that died (its state is on disk); returns their names.

        The groups are the agents' business: an agent restarted here finds its group's
        torchrun gone with it and starts the group again, which then heals from a peer.
        """
        revived = []
        for child in self.children:
            if child.proc.poll() is not None:
                child.proc = self._popen(child.name, child.argv, child.log)
                child.restarts += 1
                revived.append(child.name)
        return revived

    def _wait_http(self, child: Child, url: str) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                tail = child.log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise StartupError(f"{child.name} exited with {child.proc.returncode}: {tail[0]} (log: {child.log})")
            try:
                answer = httpx.get(url, timeout=PROBE_TIMEOUT_S)
                served_by, healthy = answer.json().get("server_pid"), answer.status_code < 500
            except (httpx.HTTPError, ValueError, AttributeError):
                served_by, healthy = None, False
            if served_by == child.proc.pid:
                if healthy:
                    return
            elif served_by is not None:
                raise StartupError(f"{url} is answered by process {served_by}, not by the {child.name} just "
                                   "started: a server of another job holds that port; stop it or pick other ports")
            time.sleep(POLL_S)
        raise StartupError(f"{child.name} did not answer {url} within {self.cfg.startup_timeout_s:.0f}s "
                           f"(log: {child.log})")

    def _wait_registered(self, groups: int) -> None:
        """Until the control plane knows every agent's address: each registers itself when it starts."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        missing: set[int] = set(range(groups))
        while time.monotonic() < deadline:
            try:
                listed = AgentList.model_validate(httpx.get(self.cfg.api + api.url(api.AGENTS), timeout=PROBE_TIMEOUT_S).json())
                missing = set(range(groups)) - {a.group for a in listed.agents}
            except (httpx.HTTPError, ValueError):
                pass
            if not missing:
                return
            time.sleep(POLL_S)
        raise StartupError(f"the agents of groups {sorted(missing)} did not register with the control plane within "
                           f"{self.cfg.startup_timeout_s:.0f}s (logs: {self.cfg.state_dir / 'logs'})")

    def trainer_args(self) -> list[str]:
        """Every group's trainer flags: the job's, then the service's, then ``--trainer-arg``."""
        cfg = self.cfg
        return [*cfg.trainer_args(), "--steps", str(cfg.steps), "--checkpoint-dir", str(cfg.state_dir / "checkpoints"),
                *([] if cfg.sdc_check else ["--no-sdc-check"]), *cfg.trainer_arg]

    def check(self, show: Callable[[str], None]) -> None:
        """The trainer's own check of the whole job (``python -m trainer --check``), in a process of
        its own, before anything starts; it tokenizes the dataset into its cache, its progress
        lines passed to ``show``. A job that would not start raises StartupError with the
        trainer's one line."""
        argv = [sys.executable, "-m", "trainer", "--check", "--groups", str(self.cfg.groups),
                "--ranks-per-group", str(self.cfg.ranks_per_group), *self.trainer_args()]
        with tempfile.TemporaryFile("w+") as stderr:  # a file: no pipe fills while stdout is read
            with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=torchrun_env(),
                                  preexec_fn=die_with_parent) as proc:
                for line in proc.stdout:
                    show(line.rstrip())
            stderr.seek(0)
            errors = stderr.read()
        if proc.returncode != 0:
            said = [ln.split("error: ", 1)[1] for ln in errors.splitlines() if "error: " in ln]
            raise StartupError(said[-1] if said else f"the trainer's check exited with {proc.returncode}: "
                               + (errors.strip().splitlines() or ["(no output)"])[-1])

    def start(self) -> None:
        cfg, py = self.cfg, sys.executable
        lighthouse = self._spawn("lighthouse", [
            py, "-m", "lighthouse", "--bind", f"{self.bind_host}:{cfg.lighthouse_port}",
            "--min-replicas", str(cfg.min_replicas), "--heartbeat-timeout-ms", str(cfg.heartbeat_timeout_ms),
            "--join-timeout-ms", str(cfg.join_timeout_ms),
            "--api-port", str(self.lighthouse_api_port)])
        self._wait_http(lighthouse, f"{self.lighthouse_api}{LIGHTHOUSE_HEALTH_PATH}")

        control = self._spawn("controlplane", [
            py, "-m", "service.controlplane", "--host", cfg.host, "--port", str(cfg.port),
            "--db", str(cfg.state_dir / "control.db"), "--groups", str(cfg.groups),
            "--ranks-per-group", str(cfg.ranks_per_group),
            "--lighthouse-api", self.lighthouse_api, "--straggler-policy", cfg.straggler_policy,
            "--straggler-factor", str(cfg.straggler_factor)])
        self._wait_http(control, f"{cfg.api}/healthz")

        trainer_args = self.trainer_args()
        for g in range(cfg.groups):
            argv = [py, "-m", "service.agent", "--group", str(g), "--groups", str(cfg.groups),
                    "--ranks-per-group", str(cfg.ranks_per_group), "--lighthouse", self.lighthouse_url,
                    "--control-plane", cfg.api, "--port", str(self.agent_ports[g]),
                    "--state-dir", str(cfg.state_dir), "--trainer-args", json.dumps(trainer_args)]
            if g < cfg.spares:
                argv += ["--spare"]
            argv += cfg.restart_flags()
            if not cfg.zygote:
                argv += ["--no-zygote"]
            self._spawn(f"agent{g}", argv)
        for g, child in zip(range(cfg.groups), self.children[2:]):
            self._wait_http(child, f"{self.agent_url(g)}{AGENT_HEALTH_PATH}")
        self._wait_registered(cfg.groups)
        agents = {g: self.agent_url(g) for g in range(cfg.groups)}
        Connection(cfg.api, self.token).save(cfg.state_dir, lighthouse=self.lighthouse_url,
                                             lighthouse_api=self.lighthouse_api, agents=agents)

    def stop(self) -> list[int]:
        """Stop agents, then the control plane, then the Lighthouse; returns pids still alive (none)."""
        order = sorted(self.children, key=lambda c: {"lighthouse": 2, "controlplane": 1}.get(c.name, 0))
        left: list[int] = []
        for child in order:
            left += end_tree(child.proc, self.cfg.stop_timeout_s)
        return wait_gone(left, REAPED_S)
