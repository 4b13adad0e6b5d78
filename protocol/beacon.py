"""A rank's progress beacon: what it is doing right now, for its agent's hang watchdog.

A thread in every rank rewrites ``{events_dir}/g{g}-r{r}.beacon`` every
:data:`BEACON_INTERVAL_S` with a :class:`Beacon`: the phase the training loop is in and since
when. The agent reads them. A beacon that stops changing means the process is stopped or its
interpreter wedged; a phase that lasts far longer than the group's steps do means a rank stuck
inside its step, unless the rank spent that time waiting for a CPU (``starved_s``: a rank on a
busy machine is slow, not stuck). Waiting on other groups (``allreduce``) is never a hang of
this group, and a checkpoint save has a bound of its own. A warm spare writes no beacon until
it is promoted: it must not cover the live group's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from protocol.files import read_model

BEACON_INTERVAL_S = 0.1
Phase = Literal["starting", "compute", "allreduce", "commit", "checkpoint", "idle"]
JUDGED_PHASES: frozenset[str] = frozenset({"compute", "commit"})
"""Phases a rank spends working on its own: one that lasts too long is stuck."""


class Beacon(BaseModel):
    pid: int
    phase: Phase
    since: float = Field(description="when the phase began (Unix time)")
    step: int = Field(description="the manager step the rank is on")
    ts: float = Field(description="when the beacon was written: its age says the thread is alive")
    starved_s: float = Field(0.0, ge=0, description="of the time in this phase until ts, how long the rank's training "
                             "thread was runnable but waiting for a CPU (Linux schedstat; 0 where it is not kept)")


def read_beacon(path: Path) -> Beacon | None:
    return read_model(path, Beacon)
