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
from protocol.job import JobSettings
from trainer.errors import ConfigError


class TrainerConfig(BaseSettings, JobSettings):
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
    # --- the job: a torchtitan config and the overrides a user changes (protocol/job.py's JobSettings)
    steps: int = Field(200, ge=1, description="train until the job's step count reaches this")
    seed: int = Field(0, description="model init and data order")
    check: bool = Field(False, description="check the whole configuration (and tokenize the dataset into its "
                        "cache) without training, then exit: 0 when it would start")

    # --- torchft
    min_replicas: int = Field(1, ge=1, description="fewest replica groups that may commit a step")
    world_size_mode: Literal["dynamic", "fixed_with_spares"] = Field(
        "dynamic",
        description="dynamic: every healthy group trains; fixed_with_spares: exactly "
        "min-replicas groups train, the rest wait as spares",
    )
    timeout_s: float = Field(10.0, gt=0, description="collectives, should_commit and heal transfers")
    collective_watch: bool = Field(True, description="end a cross-group collective as soon as a peer of the step's "
                                   "quorum is shown lost (its host takes no connection, or the Lighthouse stopped "
                                   "hearing it), instead of after --timeout-s; a slow peer is never ended")
    quorum_timeout_s: float = Field(120.0, gt=0, description="waiting for a quorum: a Lighthouse away this "
                                    "long stops the group (exit reason lighthouse-away); its agent starts it "
                                    "again once the Lighthouse answers")
    quorum_retry_s: float = Field(0.1, gt=0, description="a Lighthouse that does not answer a quorum request is "
                                  "asked again this often within --quorum-timeout-s (torchft's quorum_retries), so "
                                  "a restarted one is found at once")
    connect_timeout_s: float = Field(10.0, gt=0, description="connecting to the Lighthouse and managers")
    heartbeat_interval_ms: int = Field(100, ge=10, description="manager heartbeats to the Lighthouse")
    init_sync: bool = Field(False, description="make every group copy one group's weights at step 0 (torchft's "
                            "init_sync). Off: every group initialises the same weights from --seed, and step 0 "
                            "trains every group's samples (with it, the healing groups' step-0 samples are skipped)")
    advertise_host: str | None = Field(
        None, description="host other groups reach this group's manager and heal server at "
        "(default: this machine's hostname)",
    )

    # --- silent data corruption
    sdc_check: bool = Field(True, description="compare every group's gradient norm before gradients cross groups; "
                            "an abnormal one skips the step everywhere and is attributed by reruns "
                            "(--no-sdc-check: average at once, as plain HSDP does)")
    sdc_factor: float = Field(10.0, gt=1, description="a gradient norm above this many times the other groups' "
                              "median fails the check")

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
        if self.device == "cpu" and self.replicate_backend == "nccl":
            raise ValueError("--replicate-backend nccl needs --device cuda")
        return self

    @property
    def across_groups(self) -> Literal["gloo", "nccl"]:
        return self.replicate_backend or ("nccl" if self.device == "cuda" else "gloo")

    @property
    def precision(self) -> Literal["bf16", "fp32"]:
        return self.dtype or ("bf16" if self.device == "cuda" else "fp32")

    def global_batch(self, local_batch_size: int) -> int:
        """The samples a committed step trains, over every group: ``--global-batch-size``, or
        every rank of every group computing one microbatch."""
        batch = self.global_batch_size or self.groups * self.ranks_per_group * local_batch_size
        if self.batch_policy == "shrink" and batch % self.groups:
            raise ConfigError(f"--global-batch-size {batch} does not divide among {self.groups} groups: with "
                              "--batch-policy shrink each group trains an equal share; use a multiple of "
                              f"{self.groups}")
        return batch
