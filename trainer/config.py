"""The trainer's settings: flags, or environment variables prefixed ``FT_TRAINER_``.

torchft's usual variables are honoured too: ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol import defaults
from trainer.errors import ConfigError


class TrainerConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="FT_TRAINER_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="python -m trainer",
        cli_exit_on_error=True,
        extra="ignore",
    )

    # --- the job and this group's place in it
    lighthouse: str = Field(
        defaults.lighthouse_address(),
        validation_alias=AliasChoices("lighthouse", "TORCHFT_LIGHTHOUSE"),
        description="torchft Lighthouse address (env TORCHFT_LIGHTHOUSE)",
    )
    group: int = Field(
        0, ge=0,
        validation_alias=AliasChoices("group", "REPLICA_GROUP_ID"),
        description="this replica group's stable id g, 0..groups-1 (env REPLICA_GROUP_ID)",
    )
    groups: int = Field(
        1, ge=1,
        validation_alias=AliasChoices("groups", "NUM_REPLICA_GROUPS"),
        description="replica groups in the job (env NUM_REPLICA_GROUPS); with the seed it "
        "decides which batch each (group, rank, step) trains",
    )
    ranks_per_group: int = Field(
        defaults.RANKS_PER_GROUP, ge=1,
        description="ranks in this group (K): the processes `python -m trainer` starts under torchrun "
        "(under torchrun, its world size)",
    )
    master_port: int = Field(
        0, ge=0, le=65535,
        description="torchrun rendezvous/TCPStore port for this group when launching "
        "torchrun; 0 picks a free one",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="cpu: gloo inside and across groups. cuda: NCCL inside the group and "
        "torchft's NCCL process group across groups (written, not yet run on a GPU)",
    )

    # --- model and optimisation
    flavor: str = Field("debugmodel", description="torchtitan Llama 3 flavor (debugmodel, 1B, 3B, 8B, 70B, 405B)")
    steps: int = Field(200, ge=1, description="train until the job's step count reaches this")
    batch_size: int = Field(4, ge=1, description="samples per replica group per step; must divide by the group's ranks")
    seq_len: int = Field(128, ge=8, description="tokens per sample")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(10, ge=0, description="linear warm-up steps, then cosine decay to 10% at --steps")
    weight_decay: float = Field(0.0, ge=0)
    seed: int = Field(0, description="model init and data order")

    # --- data
    data: Path | None = Field(
        None,
        description="text or JSONL file, or a folder of them (JSONL: the 'text' field of each "
        "line). Default: the Python standard library's own source files",
    )
    data_max_bytes: int = Field(8 * 2**20, ge=1024, description="read at most this many bytes of the corpus")

    # --- torchft
    min_replicas: int = Field(1, ge=1, description="fewest replica groups that may commit a step")
    world_size_mode: Literal["dynamic", "fixed_with_spares"] = Field(
        "dynamic",
        description="dynamic: every healthy group trains; fixed_with_spares: exactly "
        "min-replicas groups train, the rest wait as spares",
    )
    timeout_s: float = Field(10.0, gt=0, description="collectives, should_commit and heal transfers")
    quorum_timeout_s: float = Field(120.0, gt=0, description="waiting for a quorum: a Lighthouse away this "
                                    "long stops the group (exit reason lighthouse-away); its agent starts it "
                                    "again once the Lighthouse answers")
    quorum_retry_s: float = Field(0.1, gt=0, description="a Lighthouse that does not answer a quorum request is "
                                  "asked again this often within --quorum-timeout-s (torchft's quorum_retries), so "
                                  "a restarted one is found at once")
    connect_timeout_s: float = Field(10.0, gt=0, description="connecting to the Lighthouse and managers")
    heartbeat_interval_ms: int = Field(100, ge=10, description="manager heartbeats to the Lighthouse")
    init_sync: bool = Field(True, description="make every group copy group 0's weights at step 0")
    advertise_host: str | None = Field(
        None, description="host other groups reach this group's manager and heal server at "
        "(default: this machine's hostname)",
    )

    # --- silent data corruption and clipping
    sdc_check: bool = Field(True, description="compare every group's gradient norm before gradients cross groups; "
                            "an abnormal one skips the step everywhere and is attributed by reruns "
                            "(--no-sdc-check: average at once, as plain HSDP does)")
    sdc_factor: float = Field(10.0, gt=1, description="a gradient norm above this many times the other groups' "
                              "median fails the check")
    max_norm: float = Field(0.0, ge=0, description="clip gradients to this global norm (over every group, after "
                            "averaging; 0: no clipping)")

    # --- checkpoints and telemetry
    checkpoint_dir: Path | None = Field(None, description="torch.distributed.checkpoint folder shared by all groups; none: no checkpoints")
    checkpoint_every: int = Field(50, ge=1, description="save every N committed steps")
    checkpoint_keep: int = Field(3, ge=1, description="keep the newest K complete checkpoints")
    checkpoint_async: bool = Field(True, description="write checkpoints off the step: the step waits only for "
                                   "the copy into CPU memory (--no-checkpoint-async: for the whole save)")
    events_dir: Path = Field(Path("ftstate/events"), description="JSON-lines event files, one per rank")
    fingerprint_every: int = Field(10, ge=1, description="hash local parameter+optimizer shards every N committed steps")
    log_every: int = Field(10, ge=1, description="rank 0 prints a progress line every N steps")
    spare_promote_file: Path | None = Field(
        None, description="start as a warm spare: build everything, mark each rank ready "
        "(PATH.ready-rN), and join the quorum only once PATH exists (the agent creates it)",
    )
    step_sleep_s: float = Field(0.0, ge=0, description="sleep after every step (slows training down for demos and drills)")

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.group >= self.groups:
            raise ValueError(f"group {self.group} is not below groups={self.groups}")
        if self.min_replicas > self.groups:
            raise ValueError(f"min-replicas={self.min_replicas} exceeds groups={self.groups}")
        return self

    def per_rank_batch(self, ranks: int) -> int:
        if self.batch_size % ranks:
            raise ConfigError(
                f"--batch-size {self.batch_size} does not divide across {ranks} ranks per "
                f"group; use a multiple of {ranks}"
            )
        return self.batch_size // ranks
