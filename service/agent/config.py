"""Settings of one agent: flags, or environment variables ``FT_AGENT_*``."""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import AliasChoices, AnyHttpUrl, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.layout import GroupLayout
from protocol import defaults
from protocol.tokens import group_token, strong_token
from service.agent.restarts import RestartSettings
from service.agent.supervisor import STOP_TIMEOUT_S
from service.agent.watchdog import WatchdogSettings

WILDCARDS = ("0.0.0.0", "::", "")
"""Bind addresses that name no host another process could call."""


class AgentSettings(BaseSettings, RestartSettings):
    model_config = SettingsConfigDict(env_prefix="FT_AGENT_", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_prog_name="python -m service.agent", extra="ignore")

    group: int = Field(ge=0, description="the replica group this agent runs")
    groups: int = Field(ge=1, description="replica groups in the job")
    ranks_per_group: int = Field(defaults.RANKS_PER_GROUP, ge=1, description="ranks (torchrun processes) in the group")
    lighthouse: str = Field(defaults.lighthouse_address(), description="torchft Lighthouse address for the trainer")
    control_plane: str | None = Field(None, description="control-plane URL to forward events to")
    token: str | None = Field(None, validation_alias=AliasChoices("token", "FTCTL_AGENT_TOKEN"),
                              description="this group's token: commands from the control plane carry it, and the "
                              "group's events go with it (`ftctl token --group G` prints it)")
    job_token: str | None = Field(None, validation_alias=AliasChoices("job_token", "FTCTL_TOKEN"), repr=False,
                                  description="the job's token instead: the agent derives its group's token from it "
                                  "and keeps only that")
    host: str = Field(defaults.LOOPBACK, description="address of this agent's HTTP API")
    allowed_hosts: list[str] = Field(default_factory=list, description="names this agent answers to besides "
                                     "loopback, --host and --advertise-host (its pod's address in Kubernetes)")
    port: int = Field(0, ge=0, le=65535, description="port of this agent's HTTP API; 0 picks a free one")
    advertise_host: str | None = Field(None, description="address other groups reach this group at (default loopback)")
    advertise_url: AnyHttpUrl | None = Field(None, description="this agent's API as the control plane reaches it, "
                                             "registered there (default http://ADVERTISE_HOST:PORT; with neither "
                                             "that nor a bind address of its own, this host's address)")
    state_dir: Path = Field(Path("ftstate"), description="events/, logs/ and checkpoints/ live here")
    trainer_args: list[str] = Field(default_factory=list, description="extra trainer flags, as a JSON list")
    autostart: bool = Field(True, description="start the group when the agent starts")
    spare: bool = Field(False, description="keep a warm spare of the group: pre-started, outside the quorum, promoted by rejoin")
    zygote: bool = Field(True, description="fork the group's ranks (and its spare's) from a process that imported "
                         "torch, torchft and the model code and read the corpus once, at agent start; off: every "
                         "start is a cold torchrun start")
    spare_respawn_delay_s: float = Field(10.0, ge=0, description="after a promotion, wait this long before starting the next spare")
    stop_timeout_s: float = Field(STOP_TIMEOUT_S, gt=0, description="graceful stop: SIGTERM, then SIGKILL after this")
    buffer_capacity: int = Field(20_000, ge=10, description="events kept while the control plane is away")
    forward_interval_s: float = Field(0.2, gt=0, description="how often new events are read and shipped")
    forward_batch: int = Field(500, ge=1, description="events per POST to the control plane")
    forward_timeout_s: float = Field(5.0, gt=0, description="a POST to the control plane slower than this failed; "
                                     "the batch is kept and sent again")
    watchdog: bool = Field(True, description="end the group when a rank stops making progress (a hang), and "
                           "treat it as a crash: fail-over to the warm spare or rejoin")
    watchdog_interval_s: float = Field(0.1, gt=0, description="how often the watchdog reads the ranks' beacons")
    watchdog_silence_s: float = Field(1.0, gt=0, description="a rank whose beacon is older than this is stopped "
                                      "or wedged (beacons are written every 0.1 s)")
    watchdog_floor_s: float = Field(1.0, gt=0, description="the shortest step bound: a rank in compute or commit "
                                    "longer than max(floor, factor × median step) is stuck")
    watchdog_factor: float = Field(3.0, gt=1, description="the step bound as a multiple of the group's median step time")
    watchdog_min_steps: int = Field(5, ge=1, description="steps of a start before its step bound applies (a "
                                    "rejoined group's first steps heal and warm up)")
    watchdog_checkpoint_s: float = Field(300.0, gt=0, description="a checkpoint save longer than this is stuck")

    @model_validator(mode="after")
    def _group_token(self) -> "AgentSettings":
        if self.token is None:
            if self.job_token is None:
                raise ValueError("no token: pass --token (FTCTL_AGENT_TOKEN, the group's) or FTCTL_TOKEN (the job's)")
            self.token = group_token(strong_token(self.job_token), self.group)
        self.job_token = None
        strong_token(self.token)
        return self

    def watchdog_settings(self) -> WatchdogSettings:
        return WatchdogSettings(self.watchdog_interval_s, self.watchdog_silence_s, self.watchdog_floor_s,
                                self.watchdog_factor, self.watchdog_min_steps, self.watchdog_checkpoint_s)

    def api_url(self) -> str:
        """The URL this agent registers (``port`` is the bound one by now, never 0)."""
        if self.advertise_url is not None:
            return str(self.advertise_url).rstrip("/")
        host = self.advertise_host or self.host
        if host in WILDCARDS:
            host = socket.gethostbyname(socket.gethostname())
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def events_dir(self) -> Path:
        return self.state_dir / "events"

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    @property
    def pid_path(self) -> Path:
        return self.run_dir / GroupLayout(self.group).pid

    @property
    def log_path(self) -> Path:
        return self.state_dir / "logs" / GroupLayout(self.group).log
