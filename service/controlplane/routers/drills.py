from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, Response

from service.controlplane.deps import Services, group_view, services
from service.controlplane.drills import DrillConflict
from service.controlplane.chaos import ChaosReport
from service.controlplane.models import DrillIn, DrillList, DrillOut, KillHealIn

router = APIRouter(prefix="/api/v1/drills", tags=["drills"])
mutating = APIRouter(prefix="/api/v1/drills", tags=["drills"])


def drill_out(row: dict) -> DrillOut:
    return DrillOut(**row, fingerprints_equal=row["report"].get("fingerprints_equal"),
                    goodput=row["report"].get("goodput"))


@mutating.post("", response_model=DrillOut, status_code=202, responses={404: {}, 409: {}, 422: {}})
async def start_drill(body: DrillIn, request: Request, response: Response, s: Services = Depends(services)) -> DrillOut:
    """Start a drill; it runs in the background. Poll ``GET /api/v1/drills/{id}``."""
    try:
        if isinstance(body, KillHealIn):
            group_view(body.group, request)
            drill_id = s.drills.start_kill_heal(body.group, body.timeout_s)
        else:
            drill_id = s.drills.start_chaos(ChaosReport(**body.model_dump(exclude={"kind"})))
    except DrillConflict as err:
        raise HTTPException(409, str(err)) from None
    response.headers["Location"] = f"/api/v1/drills/{drill_id}"
    return drill_out(s.store.drill(drill_id))


@router.get("", response_model=DrillList)
def list_drills(s: Services = Depends(services)) -> DrillList:
    return DrillList(drills=[drill_out(d) for d in s.store.drills()])


@router.get("/{drill_id}", response_model=DrillOut, responses={404: {}})
def get_drill(drill_id: int, s: Services = Depends(services)) -> DrillOut:
    row = s.store.drill(drill_id)
    if row is None:
        raise HTTPException(404, f"no drill {drill_id}")
    return drill_out(row)
