"""The job's data: what it trains on, and which samples its committed steps trained."""

from __future__ import annotations

import time

from fastapi import APIRouter

from protocol import api
from service.controlplane.coverage import DataOut, data_out
from service.controlplane.deps import ServicesDep

router = APIRouter(tags=["data"])


@router.get(api.DATA, response_model=DataOut)
def data(s: ServicesDep) -> DataOut:
    """Samples planned, trained once, trained twice and skipped by the job's committed steps so
    far (``service/controlplane/coverage.py``), and the data and batch the job trains with."""
    return data_out(s.coverage, s.store.newest_start(), time.time())
