"""How a quarantined group tells its agent why its ranks left: one file in the events folder.

Rank 0 of a group the gradient check attributed a persistent corruption to writes a
:class:`Quarantine` to ``{events_dir}/g{g}.quarantine`` before its ranks exit. The agent reads
(and removes) it when the group's processes end: the exit is then ``quarantined``, not a
crash: the agent does not start the group again on the same hardware, and promotes its warm
spare when one is ready.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from protocol.layout import GroupLayout
from protocol.files import read_model


class Quarantine(BaseModel):
    step: int = Field(description="the step whose gradient was found corrupt")
    reason: str


def quarantine_file(events_dir: Path, group: int) -> Path:
    return events_dir / GroupLayout(group).quarantine


def take_quarantine(events_dir: Path, group: int) -> Quarantine | None:
    """The group's quarantine, removed as it is read; None when its ranks were not quarantined."""
    path = quarantine_file(events_dir, group)
    found = read_model(path, Quarantine)
    path.unlink(missing_ok=True)
    return found
