"""Settings of the Lighthouse wrapper: flags, or environment variables ``FT_LIGHTHOUSE_*``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class LighthouseSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FT_LIGHTHOUSE_", cli_kebab_case=True,
                                      cli_prog_name="python -m lighthouse", extra="ignore")

    bind: str = Field("127.0.0.1:29510", description="where torchft's Lighthouse listens (gRPC + its HTML "
                      "pages); [::]:29510 to reach it from other machines")
    min_replicas: int = Field(1, ge=1, description="fewest replica groups that form a quorum")
    join_timeout_ms: int = Field(
        1000, ge=0,
        description="how long a quorum waits for heartbeating stragglers to ask to join "
        "(torchft's CLI default is 60000; short means a returning group never stalls the others)",
    )
    quorum_tick_ms: int = Field(100, ge=1, description="how often the Lighthouse re-checks for a quorum")
    heartbeat_timeout_ms: int = Field(
        1000, ge=50,
        description="a replica silent this long is dead: this is the failure-detection time T_d "
        "(torchft's default is 5000)",
    )
    api_host: str = Field("127.0.0.1", description="where this wrapper serves JSON status, /healthz and /metrics")
    api_port: int = Field(29511, ge=0, le=65535)
    restart_delay_s: float = Field(0.5, ge=0, description="wait before restarting a Lighthouse that died")

    @property
    def port(self) -> int:
        return int(self.bind.rsplit(":", 1)[1])

    @property
    def local_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        import shutil
        import sys
        from pathlib import Path

        exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
        return [
            exe, "--bind", self.bind, "--min_replicas", str(self.min_replicas),
            "--join_timeout_ms", str(self.join_timeout_ms), "--quorum_tick_ms", str(self.quorum_tick_ms),
            "--heartbeat_timeout_ms", str(self.heartbeat_timeout_ms),
        ]
