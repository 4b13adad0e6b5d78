"""`ftctl up`: starts the Lighthouse wrapper, the control plane and N agents, and stops them.

Every child runs in a session of its own so a Ctrl-C in the terminal reaches only ftctl,
which then stops them in order: agents first (each stops its group gracefully), then the
control plane, then the Lighthouse; whatever is left is killed by pid, tree by tree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.client import Connection
from service.proctree import process_tree, signal_tree, wait_gone
from trainer.launch import free_port


@dataclass
class UpConfig:
    groups: int
    nproc_per_group: int
    steps: int
    port: int
    host: str
    state_dir: Path
    lighthouse_port: int
    token: str
    trainer_args: list[str] = field(default_factory=list)
    auto_rejoin_delay_s: float | None = None
    min_replicas: int = 1
    heartbeat_timeout_ms: int = 1000
    join_timeout_ms: int = 1000
    spares: int = 0

    @property
    def api(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
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


class Cluster:
    def __init__(self, cfg: UpConfig):
        self.cfg = cfg
        self.children: list[Child] = []
        self.lighthouse_api_port = free_port()
        self.agent_ports = {g: free_port() for g in range(cfg.groups)}

    @property
    def bind_host(self) -> str:
        """Loopback unless the control plane was told to listen beyond it."""
        return "127.0.0.1" if self.cfg.host in ("127.0.0.1", "localhost") else "[::]"

    @property
    def lighthouse_url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.lighthouse_port}"

    @property
    def lighthouse_api(self) -> str:
        return f"http://127.0.0.1:{self.lighthouse_api_port}"

    def agent_url(self, group: int) -> str:
        return f"http://127.0.0.1:{self.agent_ports[group]}"

    def _popen(self, argv: list[str], log: Path) -> subprocess.Popen:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "FTCTL_TOKEN": self.cfg.token})

    def _spawn(self, name: str, argv: list[str]) -> Child:
        log = self.cfg.state_dir / "logs" / f"{name}.log"
        child = Child(name, argv, self._popen(argv, log), log)
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
                child.proc = self._popen(child.argv, child.log)
                child.restarts += 1
                revived.append(child.name)
        return revived

    def _wait_http(self, child: Child, url: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                tail = child.log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise StartupError(f"{child.name} exited with {child.proc.returncode}: {tail[0]} (log: {child.log})")
            try:
                if httpx.get(url, timeout=1.0).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise StartupError(f"{child.name} did not answer {url} within {timeout_s:.0f}s (log: {child.log})")

    def start(self) -> None:
        cfg, py = self.cfg, sys.executable
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        lighthouse = self._spawn("lighthouse", [
            py, "-m", "lighthouse", "--bind", f"{self.bind_host}:{cfg.lighthouse_port}",
            "--min-replicas", str(cfg.min_replicas), "--heartbeat-timeout-ms", str(cfg.heartbeat_timeout_ms),
            "--join-timeout-ms", str(cfg.join_timeout_ms),
            "--api-port", str(self.lighthouse_api_port)])
        self._wait_http(lighthouse, f"{self.lighthouse_api}/healthz")

        agents = {g: self.agent_url(g) for g in range(cfg.groups)}
        control = self._spawn("controlplane", [
            py, "-m", "service.controlplane", "--host", cfg.host, "--port", str(cfg.port),
            "--db", str(cfg.state_dir / "control.db"), "--groups", str(cfg.groups),
            "--nproc-per-group", str(cfg.nproc_per_group), "--agents", json.dumps(agents),
            "--lighthouse-api", self.lighthouse_api])
        self._wait_http(control, f"{cfg.api}/healthz")

        trainer_args = ["--steps", str(cfg.steps), "--checkpoint-dir", str(cfg.state_dir / "checkpoints"),
                        "--nproc-per-node", str(cfg.nproc_per_group), *cfg.trainer_args]
        for g in range(cfg.groups):
            argv = [py, "-m", "service.agent", "--group", str(g), "--groups", str(cfg.groups),
                    "--nproc-per-group", str(cfg.nproc_per_group), "--lighthouse", self.lighthouse_url,
                    "--control-plane", cfg.api, "--port", str(self.agent_ports[g]),
                    "--state-dir", str(cfg.state_dir), "--trainer-args", json.dumps(trainer_args)]
            if g < cfg.spares:
                argv += ["--spare"]
            if cfg.auto_rejoin_delay_s is not None:
                argv += ["--auto-rejoin-delay-s", str(cfg.auto_rejoin_delay_s)]
            self._spawn(f"agent{g}", argv)
        for g, child in zip(range(cfg.groups), self.children[2:]):
            self._wait_http(child, f"{self.agent_url(g)}/healthz")
        Connection(cfg.api, cfg.token).save(cfg.state_dir, lighthouse=self.lighthouse_url,
                                            lighthouse_api=self.lighthouse_api, agents=agents)

    def stop(self, timeout_s: float = 40) -> list[int]:
        """Stop agents, then the control plane, then the Lighthouse; returns pids still alive (none)."""
        order = sorted(self.children, key=lambda c: {"lighthouse": 2, "controlplane": 1}.get(c.name, 0))
        everything: list[int] = []
        for child in order:
            pids = [p.pid for p in process_tree(child.proc.pid)]
            everything += pids
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            for pid in wait_gone(pids, timeout_s):
                signal_tree(pid, signal.SIGKILL)
            if child.proc.poll() is None:
                child.proc.kill()
            child.proc.wait()
        return wait_gone(everything, 5)
