from __future__ import annotations

from typing import get_args

from fastapi import APIRouter, Query

from protocol import api
from protocol.events import SdcEvent, Verdict
from service.controlplane.deps import ServicesDep
from service.controlplane.models import SdcOut

router = APIRouter(tags=["sdc"])


@router.get(api.SDC, response_model=SdcOut)
def sdc(s: ServicesDep, limit: int = Query(50, ge=1, le=1000, description="the newest this many incidents")) -> SdcOut:
    """Silent data corruption the gradient check caught: counts by verdict and the newest incidents."""
    counts = s.store.count_by("sdc", "verdict")
    incidents = [e for e in s.store.newest_events("sdc", limit) if isinstance(e, SdcEvent)]
    return SdcOut(counts={v: counts.get(v, 0) for v in get_args(Verdict)}, incidents=incidents)
