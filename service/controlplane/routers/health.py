from __future__ import annotations

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from fastapi import APIRouter, Depends, Response

from service.controlplane.deps import Services, services
from service.controlplane.models import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """Liveness: the process answers."""
    return Health(ok=True)


@router.get("/metrics", include_in_schema=False)
def metrics(s: Services = Depends(services)) -> Response:
    """Prometheus exposition of the job's metrics."""
    return Response(generate_latest(s.metrics_registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(response: Response, s: Services = Depends(services)) -> Health:
    """Readiness: SQLite answers and the Lighthouse wrapper answers."""
    checks = {}
    try:
        s.store.events(limit=1)
        checks["sqlite"] = "ok"
    except Exception as err:  # any failure of the store means not ready
        checks["sqlite"] = str(err)
    try:
        (await s.lighthouse.get("/healthz")).raise_for_status()
        checks["lighthouse"] = "ok"
    except httpx.HTTPError as err:
        checks["lighthouse"] = f"{s.settings.lighthouse_api}: {err}"
    ok = all(v == "ok" for v in checks.values())
    if not ok:
        response.status_code = 503
    return Health(ok=ok, checks=checks)
