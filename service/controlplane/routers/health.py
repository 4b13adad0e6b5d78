from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.controlplane.deps import ServicesDep
from service.controlplane.exposition import exposition
from service.controlplane.lighthouse import LighthouseUnreachable
from service.controlplane.models import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """Liveness: the process answers."""
    return Health(ok=True)


@router.get("/metrics", include_in_schema=False)
async def metrics(s: ServicesDep) -> StreamingResponse:
    """Prometheus exposition of the job's metrics, written a slice at a time between other work."""
    await asyncio.to_thread(s.metrics_state.refresh)
    return StreamingResponse(exposition(s.metrics_registry.collect()), media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(response: Response, s: ServicesDep) -> Health:
    """Readiness: SQLite answers and the Lighthouse wrapper answers."""
    checks = {}
    try:
        s.store.events(limit=1)
        checks["sqlite"] = "ok"
    except Exception as err:  # any failure of the store means not ready
        checks["sqlite"] = str(err)
    try:
        await s.lighthouse.check_health()
        checks["lighthouse"] = "ok"
    except LighthouseUnreachable as err:
        checks["lighthouse"] = str(err)
    ok = all(v == "ok" for v in checks.values())
    if not ok:
        response.status_code = 503
    return Health(ok=ok, checks=checks)
