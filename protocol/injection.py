"""Faults a drill injects into a live group, through the group's agent (``POST /inject``).

``stop`` is the agent's own doing: it SIGSTOPs the ranks (all, or one), as a hung node or a
wedged driver leaves them. The other kinds need the rank's help: the agent writes an
:class:`Injection` to ``{events_dir}/g{g}.inject``, and every rank of the group reads it
(a new ``id`` is a new injection) and acts on it inside its next step: ``stuck`` sleeps there
once, ``slow`` sleeps ``delay_ms`` before every forward until ``until`` (a straggler; with
``every`` N, only at the steps whose number is ``offset`` modulo N: given to each group with its
own offset, slowness that moves from group to group step by step, as uneven batches make it),
``corrupt`` multiplies the largest element of the first gradient shard it hands to the
cross-group all-reduce by ``scale`` (at its next step, or every step until ``until`` when
``persistent``: silent data corruption), ``watch`` measures every step's update norm until
``until``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.events import Flag
from protocol.files import read_model

INJECT_PATH = "/inject"
InjectedKind = Literal["stop", "stuck", "slow", "corrupt", "watch"]
HangKind = Literal["stop", "stuck"]


class InjectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: InjectedKind = Field(description="stop: SIGSTOP the ranks; stuck: the rank sleeps inside its step; "
                               "slow: the ranks sleep before every forward for a while; corrupt: one element of "
                               "the rank's gradient is scaled (rank 0 unless one is named); watch: the ranks "
                               "measure their update norm for a while")
    rank: int | None = Field(None, ge=0, le=1_000_000, description="only this rank of the group (default: every rank)")
    seconds: float = Field(3600.0, gt=0, le=86_400, description="stuck: how long the rank sleeps inside its step; "
                           "slow: how long the ranks stay slow")
    delay_ms: float = Field(0.0, ge=0, le=60_000, description="slow: the sleep before every forward")
    every: int = Field(1, ge=1, le=10_000, description="slow: only at every `every`-th step, those whose number is "
                       "`offset` modulo `every` (default: every step)")
    offset: int = Field(0, ge=0, le=9_999, description="slow: which of the `every` steps (below `every`)")
    scale: float = Field(1e4, ge=-1e30, le=1e30, description="corrupt: the factor the gradient element is multiplied by")
    persistent: Flag = Field(False, description="corrupt: every step (for `seconds`), not once")

    @model_validator(mode="after")
    def _offset_below_every(self) -> "InjectRequest":
        if self.offset >= self.every:
            raise ValueError(f"offset {self.offset} must be below every {self.every}: the steps whose number is "
                             f"offset modulo every are slowed")
        return self


class InjectResult(BaseModel):
    group: int
    kind: InjectedKind
    ranks: list[int] = Field(description="the ranks the fault was injected into")
    pids: list[int] = Field(description="their processes")
    at: float = Field(description="when the fault was injected (Unix time)")


class Injection(BaseModel):
    """What the ranks read: injection ``id`` for the processes ``pids`` (the group's ranks that
    were up, or the one asked for; a warm spare of the group, started before, is not one)."""

    id: int
    kind: Literal["stuck", "slow", "corrupt", "watch"]
    rank: int | None
    pids: list[int]
    seconds: float
    delay_s: float = 0.0
    every: int = 1
    offset: int = 0
    until: float = Field(0.0, description="slow, watch, persistent corrupt: Unix time it ends")
    scale: float = 1.0
    persistent: bool = False


def read_injection(path: Path) -> Injection | None:
    return read_model(path, Injection)
