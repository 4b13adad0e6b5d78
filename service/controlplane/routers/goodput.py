"""Goodput at scale: the ledger fed with the recovery times this cluster's drills measured."""

from __future__ import annotations

import json
import statistics

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel, Field

from service.controlplane.deps import Services, services
from service.ledger import Cluster, NoProgress, Recovery, goodput

router = APIRouter(prefix="/api/v1", tags=["goodput"])

# The seed's scenario C (async checkpoints, heartbeat detection, in-process restart, local
# load): the classic path at its best, used when no measured classic baseline is configured.
SEED_CLASSIC = {"detect_s": 60.0, "restart_s": 30.0, "load_s": 60.0}


class MeasuredRecovery(BaseModel):
    drills: int
    detect_s: float = Field(description="kill → a survivor's quorum changed (median)")
    reconfigure_s: float = Field(description="detection → survivors commit again (median)")
    rejoin_to_healed_commit_s: float
    survivor_steps_lost: float
    step_s: float | None


class Projection(BaseModel):
    path: str
    gpus: int
    mtbf_h: float
    tau_s: float
    goodput: float
    dominant: str
    loss_per_failure_s: float
    terms: dict[str, float]
    inputs: dict[str, float]


class GoodputOut(BaseModel):
    measured: MeasuredRecovery
    classic_source: str
    projections: list[Projection]
    answer: list[str]


class NothingMeasured(ValueError):
    pass


def _measured(s: Services) -> MeasuredRecovery:
    reports = [d["report"] for d in s.store.drills(1000) if d["kind"] == "kill-heal" and d["status"] == "done"]
    if not reports:
        raise NothingMeasured("no kill-heal drill has finished yet: run one (ftctl drill kill-heal --group G) "
                              "so there are recovery times to project")
    steps = [v.step_s for v in s.hub.views.values() if v.step_s]
    return MeasuredRecovery(
        drills=len(reports),
        detect_s=statistics.median(r["detect_s"] for r in reports),
        reconfigure_s=statistics.median(r["survivors_resume_s"] - r["detect_s"] for r in reports),
        rejoin_to_healed_commit_s=statistics.median(r["rejoin_to_healed_commit_s"] for r in reports),
        survivor_steps_lost=statistics.median(r["survivors_steps_lost"] for r in reports),
        step_s=statistics.median(steps) if steps else None,
    )


def _classic(s: Services) -> tuple[dict[str, float], str]:
    path = s.settings.classic_recovery_json
    if path is None or not path.is_file():
        return SEED_CLASSIC, "assumed: the seed's scenario C (detect 60 s, restart 30 s, load 60 s)"
    runs = json.loads(path.read_text())["classic"]
    restart = statistics.median(r["kill_to_full_s"] for r in runs)
    load = statistics.median(r["restart_split"]["checkpoint_s"] for r in runs)
    return {"detect_s": 0.0, "restart_s": restart - load, "load_s": load}, f"measured by bench/recovery ({path.name})"


@router.get("/goodput", response_model=GoodputOut, responses={409: {}, 422: {}})
def projected_goodput(
    gpus: list[int] = Query([1024, 16384], description="cluster sizes to project to"),
    gpu_mtbf_hours: float = Query(50_000.0, gt=0, description="per-GPU MTBF (Llama 3: ~50,700 h)"),
    gpus_per_group: int = Query(8, ge=1, description="GPUs one replica group loses when a GPU fails"),
    delta_s: float = Query(10.0, ge=0, description="exposed seconds of one checkpoint"),
    s: Services = Depends(services),
) -> GoodputOut:
    """At N GPUs with this cluster's measured recovery, what goodput would the job keep?

    This service: T_d measured, T_r = reconfiguration (survivors do not restart), T_l = the
    rejoin's capacity loss (one group of N/gpus_per_group missing while it heals), rollback =
    the survivor steps lost × step time. The classic path: a whole-job restart and a reload,
    rollback τ/2.
    """
    try:
        return project(s, gpus, gpu_mtbf_hours, gpus_per_group, delta_s)
    except NothingMeasured as err:
        raise HTTPException(409, str(err)) from None
    except NoProgress as err:
        raise HTTPException(422, str(err)) from None


def project(s: Services, gpus: list[int], gpu_mtbf_hours: float = 50_000.0, gpus_per_group: int = 8,
            delta_s: float = 10.0) -> GoodputOut:
    m = _measured(s)
    classic, source = _classic(s)
    projections, answer = [], []
    for n in gpus:
        cluster = Cluster(n, gpu_mtbf_hours)
        groups = max(1, n // gpus_per_group)
        ours = Recovery(detect_s=m.detect_s, restart_s=m.reconfigure_s,
                        load_s=m.rejoin_to_healed_commit_s / groups, delta_s=delta_s,
                        rollback_s=m.survivor_steps_lost * (m.step_s or 0.0))
        theirs = Recovery(detect_s=classic["detect_s"], restart_s=classic["restart_s"], load_s=classic["load_s"],
                          delta_s=delta_s)
        for label, rec in (("this service (measured)", ours), ("classic restart", theirs)):
            try:
                g = goodput(cluster, rec)
            except NoProgress as err:
                raise NoProgress(f"{label} at {n} GPUs: {err}") from None
            projections.append(Projection(path=label, gpus=n, mtbf_h=g.mtbf_s / 3600, tau_s=g.tau_s, goodput=g.goodput,
                                          dominant=g.dominant, loss_per_failure_s=g.loss_per_failure_s, terms=g.terms,
                                          inputs={"detect_s": rec.detect_s, "restart_s": rec.restart_s,
                                                  "load_s": rec.load_s, "delta_s": delta_s,
                                                  "rollback_s": rec.rollback_s if rec.rollback_s is not None else g.tau_s / 2}))
        ours_g, classic_g = projections[-2], projections[-1]
        answer.append(f"at {n} GPUs with our measured recovery, goodput would be {100 * ours_g.goodput:.1f}%, "
                      f"dominant term {ours_g.dominant}; the classic path: {100 * classic_g.goodput:.1f}%, "
                      f"dominant term {classic_g.dominant}")
    return GoodputOut(measured=m, classic_source=source, projections=projections, answer=answer)
