from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from protocol.events import INT64_MAX
from service.controlplane.deps import ServicesDep, find_group
from service.controlplane.errors import UnknownDrill
from service.controlplane.models import (
    ChaosReport,
    CorruptIn,
    CorruptReport,
    DrillIn,
    DrillList,
    DrillOut,
    HangIn,
    HangReport,
    KillHealIn,
    KillHealReport,
    LighthouseIn,
    LighthouseReport,
    PartitionIn,
    PartitionReport,
    StragglerIn,
    StragglerReport,
)

router = APIRouter(prefix="/api/v1/drills", tags=["drills"])
mutating = APIRouter(prefix="/api/v1/drills", tags=["drills"])


REPORTS = {"kill-heal": KillHealReport, "hang": HangReport, "lighthouse": LighthouseReport, "chaos": ChaosReport,
           "straggler": StragglerReport, "corrupt": CorruptReport, "partition": PartitionReport}


def drill_out(row: dict) -> DrillOut:
    report = REPORTS[row["kind"]].model_validate(row["report"])
    return DrillOut(**{**row, "report": report}, fingerprints_equal=row["report"].get("fingerprints_equal"),
                    goodput=row["report"].get("goodput"))


@mutating.post("", response_model=DrillOut, status_code=202, responses={404: {}, 409: {}, 422: {}})
async def start_drill(body: DrillIn, response: Response, s: ServicesDep) -> DrillOut:
    """Start a drill; it runs in the background. Poll ``GET /api/v1/drills/{id}``."""
    if isinstance(body, KillHealIn):
        find_group(s, body.group)
        drill_id = s.drills.start_kill_heal(body.group, body.timeout_s)
    elif isinstance(body, HangIn):
        find_group(s, body.group)
        drill_id = s.drills.start_hang(body.group, body.rank, body.mode, body.timeout_s)
    elif isinstance(body, LighthouseIn):
        drill_id = s.drills.start_lighthouse(body.down_s, body.timeout_s)
    elif isinstance(body, StragglerIn):
        find_group(s, body.group)
        drill_id = s.drills.start_straggler(StragglerReport(**body.model_dump(exclude={"kind", "policy"}),
                                                            policy=body.policy or s.settings.straggler_policy))
    elif isinstance(body, CorruptIn):
        find_group(s, body.group)
        drill_id = s.drills.start_corrupt(CorruptReport(**body.model_dump(exclude={"kind", "timeout_s"})), body.timeout_s)
    elif isinstance(body, PartitionIn):
        for g in body.groups:
            find_group(s, g)
        drill_id = s.drills.start_partition(body)
    else:
        drill_id = s.drills.start_chaos(ChaosReport(**body.model_dump(exclude={"kind"})))
    response.headers["Location"] = f"/api/v1/drills/{drill_id}"
    return drill_out(s.store.drill(drill_id))


@router.get("", response_model=DrillList)
def list_drills(s: ServicesDep) -> DrillList:
    return DrillList(drills=[drill_out(d) for d in s.store.drills()])


DrillId = Annotated[int, Path(ge=1, le=INT64_MAX)]


def _drill(s: ServicesDep, drill_id: int) -> dict:
    row = s.store.drill(drill_id)
    if row is None:
        raise UnknownDrill(f"no drill {drill_id}; GET /api/v1/drills lists them")
    return row


@router.get("/{drill_id}", response_model=DrillOut, responses={404: {}, 422: {}})
def get_drill(drill_id: DrillId, s: ServicesDep) -> DrillOut:
    return drill_out(_drill(s, drill_id))


@mutating.delete("/{drill_id}", response_model=DrillOut, responses={404: {}, 409: {}, 422: {}})
async def cancel_drill(drill_id: DrillId, s: ServicesDep) -> DrillOut:
    """Cancel the running drill: it ends ``cancelled`` with what it measured so far, and the
    groups are free for kill and rejoin again."""
    _drill(s, drill_id)
    await s.drills.cancel_drill(drill_id)
    return drill_out(_drill(s, drill_id))
