"""Settings of the control plane: flags, or environment variables ``FT_CP_*``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol import defaults
from protocol.tokens import strong_token
from protocol.http_guard import MAX_BODY_BYTES


class ControlPlaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FT_CP_", cli_kebab_case=True,
                                      cli_prog_name="python -m service.controlplane", extra="ignore")

    host: str = Field(defaults.LOOPBACK, description="bind address (loopback unless told otherwise)")
    port: int = Field(defaults.CONTROL_PLANE_PORT, ge=0, le=65535)
    token: Annotated[str, AfterValidator(strong_token)] = Field(
        validation_alias=AliasChoices("token", "FTCTL_TOKEN"), description="the job's bearer token: every mutating "
        "request must carry it (an agent posting its group's events: that group's token, derived from it)")
    allowed_hosts: list[str] = Field(default_factory=list, description="names this server answers to besides "
                                     "loopback (a Host header with another is refused: DNS rebinding); '*': any")
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024, description="a larger request body is refused (413)")
    db: Path = Field(Path("ftstate/control.db"), description="SQLite file: events, group history, drills")
    event_retention_s: float = Field(7 * 86_400.0, gt=0, description="events older than this are deleted from "
                                     "SQLite (group states, transitions and drill reports stay)")
    event_retention_rows: int = Field(5_000_000, ge=1000, description="at most this many events are kept, the "
                                      "newest (a thousand groups at 5 steps/s write 5,000 a second)")
    groups: int = Field(2, ge=0, description="replica groups the job starts with, shown before their agents "
                        "register (an agent that registers another group number adds it)")
    ranks_per_group: int = Field(defaults.RANKS_PER_GROUP, ge=1,
                                 description="ranks per group (fingerprints are compared per rank)")
    max_groups: int = Field(4096, ge=1, le=1_000_000, description="the most replica groups the job may grow to "
                            "(group numbers 0..N-1): what the control plane keeps per group is bounded by it")
    lighthouse_api: str = Field(f"http://{defaults.LOOPBACK}:{defaults.LIGHTHOUSE_API_PORT}",
                                description="the Lighthouse wrapper's JSON API")
    classic_recovery_json: Path | None = Field(
        None, description="bench/recovery's JSON: the classic path's measured times for GET /goodput")
    drill_timeout_s: float = Field(180.0, gt=0, description="a drill phase that takes longer fails the drill")
    spares_timeout_s: float = Field(300.0, gt=0, description="chaos: a warm spare not ready after this fails the "
                                    "drill before its baseline")
    settle_timeout_s: float = Field(120.0, gt=0, description="chaos: after the window, wait this long at most for "
                                    "the last killed groups to heal")
    agent_timeout_s: float = Field(30.0, gt=0, description="an agent that takes longer to answer a command is "
                                   "unreachable (a graceful stop can take its stop timeout)")
    lighthouse_timeout_s: float = Field(3.0, gt=0, description="the Lighthouse wrapper answering slower than this "
                                        "is unreachable")
    listener_capacity: int = Field(10_000, ge=100, description="events queued for one slow listener (an SSE "
                                   "client, a drill) before it misses some; ingestion never waits")
    max_batches_per_s: float = Field(2000.0, gt=0, description="the agents' event batches a second the control "
                                     "plane paces them to, together: each is asked to send at most every "
                                     "groups / this seconds (its own interval when that is longer)")
    liveness_interval_s: float = Field(1.0, gt=0, description="how often every group's agent is asked whether it "
                                       "is there (and the Lighthouse for heartbeats)")
    lost_after_s: float = Field(2.0, gt=0, description="a group whose agent has not answered this long, and "
                                "whose heartbeat the Lighthouse dropped, is down (lost)")
    straggler_window: int = Field(10, ge=3, le=1000, description="committed steps of each group the straggler "
                                  "detector looks at")
    straggler_factor: float = Field(1.15, gt=1, description="a group computing this much longer than its peers' "
                                    "median, and waiting least, is a straggler")
    straggler_policy: Literal["flag", "evict"] = Field(
        "flag", description="flag: show it; evict: also end it (a warm spare takes its place) when keeping it costs "
        "more of the throughput than losing it")
    max_clock_skew_s: float = Field(300.0, gt=0, description="an event stamped further ahead of this server's "
                                    "clock is refused (a wrong clock would reorder every group's history)")
    max_event_age_s: float = Field(7 * 86_400.0, gt=0, description="an event older than this is refused; events "
                                   "buffered while the control plane was away are younger")
    stream_keepalive_s: float = Field(10.0, gt=0, description="an idle event stream sends a comment this often")
    quorum_view_max_age_s: float = Field(0.5, ge=0, description="GET /quorum answers with the Lighthouse's "
                                         "status as asked for at most this long ago, one fetch for every viewer")
    gc_thaw_every_s: float = Field(600.0, gt=0, description="objects that survived a full garbage collection are "
                                   "frozen, so later passes skip them; this often they are collected once again "
                                   "(one pause of up to 0.2 s at 1,000 groups), reclaiming cycles that died meanwhile")
