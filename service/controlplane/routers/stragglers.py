from __future__ import annotations


from fastapi import APIRouter

from protocol import api
from service.controlplane.deps import ServicesDep
from service.controlplane.models import StragglersOut

router = APIRouter(tags=["stragglers"])


@router.get(api.STRAGGLERS, response_model=StragglersOut)
def stragglers(s: ServicesDep) -> StragglersOut:
    """The straggler detector's latest verdict over every training group's last window of steps."""
    t = s.stragglers
    v = t.verdict
    return StragglersOut(
        pattern=v.pattern, flagged=t.flagged, slowdown=v.slowdown if v.group == t.flagged else None,
        policy=t.policy, factor=t.factor, window=t.window,
        groups=[score for _, score in sorted(v.scores.items())],
    )
