from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ControlPlaneSettings(BaseSettings):
    """Settings of the control plane: flags, or environment variables ``FT_CP_*``."""

    model_config = SettingsConfigDict(env_prefix="FT_CP_", cli_kebab_case=True,
                                      cli_prog_name="python -m service.controlplane", extra="ignore")

    host: str = Field("127.0.0.1", description="bind address (loopback unless told otherwise)")
    port: int = Field(8000, ge=0, le=65535)
    token: str = Field(validation_alias=AliasChoices("token", "FTCTL_TOKEN"),
                       description="bearer token every mutating request must carry")
    db: Path = Field(Path("ftstate/control.db"), description="SQLite file: events, group history, drills")
    groups: int = Field(2, ge=1, description="replica groups in the job")
    nproc_per_group: int = Field(2, ge=1, description="ranks per group (fingerprints are compared per rank)")
    agents: dict[int, str] = Field(default_factory=dict, description='agent URL per group, JSON: {"0": "http://127.0.0.1:8100"}')
    lighthouse_api: str = Field("http://127.0.0.1:29511", description="the Lighthouse wrapper's JSON API")
    classic_recovery_json: Path | None = Field(
        None, description="bench/recovery's JSON: the classic path's measured times for GET /api/v1/goodput")
    drill_timeout_s: float = Field(180.0, gt=0, description="a drill phase that takes longer fails the drill")
