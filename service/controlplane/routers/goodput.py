"""Goodput at scale: the ledger fed with the recovery times this cluster's drills measured."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import Field

from protocol import api
from service.controlplane.deps import ServicesDep
from service.controlplane.goodput import DEFAULT_GPUS, MAX_GPUS, Assumptions, GoodputOut, projection

router = APIRouter(tags=["goodput"])


@router.get(api.GOODPUT, response_model=GoodputOut, responses={409: {}, 422: {}})
def projected_goodput(
    s: ServicesDep, assumptions: Annotated[Assumptions, Query()],
    gpus: list[Annotated[int, Field(ge=1, le=MAX_GPUS)]] = Query(list(DEFAULT_GPUS), max_length=20,
                                                                 description="cluster sizes to project to"),
) -> GoodputOut:
    """At N GPUs with this cluster's measured recovery, what goodput would the job keep?

    This service: T_d measured, T_r = reconfiguration (survivors do not restart), T_l = the
    rejoin's capacity loss (one group of N/gpus_per_group missing while it heals), rollback =
    the survivor steps lost × step time. The classic path: a whole-job restart and a reload,
    rollback τ/2. With ``state_gb_per_rank`` and ``heal_gb_per_s`` ("8B on 8 GPUs per group
    at 25 GB/s": 12 and 25), the rejoin's transfer is that state at that speed.
    """
    return projection(s.store, s.board.median_step_s(), s.settings.classic_recovery_json, gpus, assumptions)
