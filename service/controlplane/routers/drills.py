from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response

from protocol import api
from protocol.events import JSON_INT_MAX
from service.controlplane.deps import ServicesDep, find_group
from service.controlplane.drills import DRILLS, DrillIn, DrillKindOut, DrillList, DrillOut, drill_out, kind_out
from service.controlplane.errors import UnknownDrill

router = APIRouter(tags=["drills"])
mutating = APIRouter(tags=["drills"])


@mutating.post(api.DRILLS, response_model=DrillOut, status_code=202, responses={404: {}, 409: {}, 422: {}})
async def start_drill(body: DrillIn, response: Response, s: ServicesDep) -> DrillOut:
    """Start a drill; it runs in the background. Poll ``GET /drills/{id}``."""
    for g in body.groups:
        find_group(s, g)
    drill_id = s.drills.start(body)
    response.headers["Location"] = api.url(api.DRILL, drill_id=drill_id)
    return drill_out(s.store.drill(drill_id))


@router.get(api.DRILLS, response_model=DrillList)
def list_drills(s: ServicesDep) -> DrillList:
    return DrillList(drills=[drill_out(d) for d in s.store.drills()])


@router.get(api.DRILL_KINDS, response_model=list[DrillKindOut])
def drill_kinds() -> list[DrillKindOut]:
    """Every drill kind: what it does, the fault class it measures, its request's schema."""
    return [kind_out(d) for d in DRILLS.values()]


DrillId = Annotated[int, Path(ge=1, le=JSON_INT_MAX)]


def _drill(s: ServicesDep, drill_id: int) -> dict:
    row = s.store.drill(drill_id)
    if row is None:
        raise UnknownDrill(f"no drill {drill_id}; GET {api.url(api.DRILLS)} lists them")
    return row


@router.get(api.DRILL, response_model=DrillOut, responses={404: {}, 422: {}})
def get_drill(drill_id: DrillId, s: ServicesDep) -> DrillOut:
    return drill_out(_drill(s, drill_id))


@mutating.delete(api.DRILL, response_model=DrillOut, responses={404: {}, 409: {}, 422: {}})
async def cancel_drill(drill_id: DrillId, s: ServicesDep) -> DrillOut:
    """Cancel the running drill: it ends ``cancelled`` with what it measured so far, and the
    groups are free for kill and rejoin again."""
    _drill(s, drill_id)
    await s.drills.cancel_drill(drill_id)
    return drill_out(_drill(s, drill_id))
