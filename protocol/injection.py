"""Faults a drill injects into a live group, through the group's agent (``POST /inject``).

``stop`` is the agent's own doing: it SIGSTOPs the ranks (all, or one), as a hung node or a
wedged driver leaves them. The other kinds need the rank's help: the agent writes an
:class:`Injection` to ``{events_dir}/g{g}.inject``, and every rank of the group reads it
(a new ``id`` is a new injection) and acts on it inside its next step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from protocol.files import read_model

INJECT_PATH = "/inject"
InjectedKind = Literal["stop", "stuck"]


class InjectRequest(BaseModel):
    kind: InjectedKind = Field(description="stop: SIGSTOP the ranks; stuck: the rank sleeps inside its step")
    rank: int | None = Field(None, ge=0, description="only this rank of the group (default: every rank)")
    seconds: float = Field(3600.0, gt=0, description="stuck: how long the rank sleeps inside its step")


class InjectResult(BaseModel):
    group: int
    kind: InjectedKind
    ranks: list[int] = Field(description="the ranks the fault was injected into")
    pids: list[int] = Field(description="their processes")
    at: float = Field(description="when the fault was injected (Unix time)")


class Injection(BaseModel):
    """What the ranks read: injection ``id`` for ``rank`` (None: every rank)."""

    id: int
    kind: Literal["stuck"]
    rank: int | None
    seconds: float


def injection_file_name(group: int) -> str:
    return f"g{group}.inject"


def read_injection(path: Path) -> Injection | None:
    return read_model(path, Injection)
