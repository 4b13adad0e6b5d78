"""Settings of the Lighthouse wrapper: flags, or environment variables ``FT_LIGHTHOUSE_*``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol import defaults
from protocol.tokens import strong_token


class LighthouseSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FT_LIGHTHOUSE_", cli_kebab_case=True,
                                      cli_prog_name="python -m lighthouse", extra="ignore")

    bind: str = Field(f"{defaults.LOOPBACK}:{defaults.LIGHTHOUSE_PORT}",
                      description="where torchft's Lighthouse listens (gRPC + its HTML pages); "
                      f"[::]:{defaults.LIGHTHOUSE_PORT} to reach it from other machines")
    min_replicas: int = Field(1, ge=1, description="fewest replica groups that form a quorum")
    join_timeout_ms: int = Field(
        defaults.JOIN_TIMEOUT_MS, ge=0,
        description="how long a quorum waits for heartbeating stragglers to ask to join "
        "(torchft's CLI default is 60000; short means a returning group never stalls the others)",
    )
    quorum_tick_ms: int = Field(defaults.QUORUM_TICK_MS, ge=1, description="how often the Lighthouse re-checks for a quorum")
    heartbeat_timeout_ms: int = Field(
        defaults.HEARTBEAT_TIMEOUT_MS, ge=50,
        description="a replica silent this long is dead: this is the failure-detection time T_d "
        "(torchft's default is 5000)",
    )
    api_host: str = Field(defaults.LOOPBACK, description="where this wrapper serves JSON status, /healthz and /metrics")
    api_port: int = Field(defaults.LIGHTHOUSE_API_PORT, ge=0, le=65535)
    token: Annotated[str, AfterValidator(strong_token)] | None = Field(
        None, validation_alias=AliasChoices("token", "FTCTL_TOKEN", "FT_LIGHTHOUSE_TOKEN"),
        description="bearer token for POST /kill (the Lighthouse drill); none: /kill is refused")
    allowed_hosts: list[str] = Field(default_factory=list, description="names this wrapper answers to besides "
                                     "loopback and --api-host")
    restart_delay_s: float = Field(0.5, ge=0, description="wait before restarting a Lighthouse that died")
    status_timeout_s: float = Field(2.0, gt=0, description="a Lighthouse whose status page takes longer is down")
    stop_timeout_s: float = Field(5.0, gt=0, description="on shutdown: SIGTERM the Lighthouse, SIGKILL it after this")

    @property
    def port(self) -> int:
        return int(self.bind.rsplit(":", 1)[1])

    @property
    def local_url(self) -> str:
        return f"http://{defaults.LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
        return [
            exe, "--bind", self.bind, "--min_replicas", str(self.min_replicas),
            "--join_timeout_ms", str(self.join_timeout_ms), "--quorum_tick_ms", str(self.quorum_tick_ms),
            "--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms),
        ]
