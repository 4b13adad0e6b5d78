"""Drills: scripted failures the control plane runs against the live job and reports on.

Each kind is one module here holding one :class:`~.base.Drill` subclass: its request, its report,
its preconditions and its run. Importing this package imports every module in it, which
registers every kind in :data:`DRILLS`; the REST API, ``ftctl drill``, the terminal table, the
metrics' label values and the page read it. Adding a drill kind is adding a module.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field

from service.controlplane.drills.base import Drill, DrillBody, FaultClass

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

DRILLS: dict[str, type[Drill]] = dict(sorted(Drill.registry.items()))
"""Every drill kind, by name."""

FAULT_CLASSES: dict[str, type[Drill]] = {d.fault_class.name: d for d in sorted(
    (d for d in DRILLS.values() if d.fault_class), key=lambda d: d.fault_class.name)}
"""The detection matrix's fault classes, each with the drill that measures it."""
if len(FAULT_CLASSES) < sum(1 for d in DRILLS.values() if d.fault_class):
    raise TypeError("two drills measure the same fault class; a kind that inherits one sets fault_class = None")

DrillIn = Annotated[Union[tuple(d.Request for d in DRILLS.values())], Field(discriminator="kind")]
"""``POST /drills``'s body: any kind's request."""

DrillReport = Union[tuple(d.Report for d in DRILLS.values())]


class DrillOut(BaseModel):
    id: int
    kind: Literal[tuple(DRILLS)]
    group: int | None
    status: Literal["running", "done", "failed", "cancelled"]
    created: float
    updated: float
    error: str | None = None
    fingerprints_equal: bool | None = None
    goodput: float | None = None
    report: DrillReport


class DrillList(BaseModel):
    drills: list[DrillOut]


class DrillKindOut(BaseModel):
    """A drill kind, as the page and clients learn it."""

    kind: str
    summary: str
    fault_class: str | None = Field(description="the detection matrix's fault class it measures")
    resume_key: str | None = Field(description="its report's key for 'trains again' (detection is detect_s)")
    request_schema: dict


def kind_out(drill: type[Drill]) -> DrillKindOut:
    fault = drill.fault_class
    return DrillKindOut(kind=drill.kind, summary=drill.summary, fault_class=fault and fault.name,
                        resume_key=fault and fault.resume_key, request_schema=drill.Request.model_json_schema())


def drill_out(row: dict) -> DrillOut:
    """A drills-table row as the API shows it: its report typed by its kind."""
    report = DRILLS[row["kind"]].Report.model_validate(row["report"])
    return DrillOut(**{**row, "report": report}, fingerprints_equal=row["report"].get("fingerprints_equal"),
                    goodput=row["report"].get("goodput"))


__all__ = ["DRILLS", "FAULT_CLASSES", "Drill", "DrillBody", "DrillIn", "DrillKindOut", "DrillList", "DrillOut",
           "FaultClass", "drill_out", "kind_out"]
