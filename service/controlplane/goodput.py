"""Goodput at scale: the ledger (``service/ledger.py``) fed with this cluster's measured recovery.

This service: T_d measured per fault class and weighted by how often each occurs (a crash's
T_d from the kill-heal drills, a hang's from the hang drills: the watchdog's, not a crash's),
T_r = reconfiguration (survivors do not restart), T_l = the
rejoin's capacity loss (one group of N/gpus_per_group missing while it heals; the heal's transfer
scaled to the state per rank and the link's speed asked about), rollback = the
survivor steps lost × step time. The classic path: a whole-job restart and a reload, rollback
τ/2, from bench/recovery's measurement when configured, else the seed's scenario C. Used by
``GET /goodput`` and by the metrics (``ftctl_goodput_projected_ratio``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from service.controlplane.db import Store
from service.controlplane.errors import InvalidQuery, NothingMeasured
from service.ledger import Cluster, NoProgress, Recovery, goodput

# The seed's scenario C (async checkpoints, heartbeat detection, in-process restart, local
# load): the classic path at its best, used when no measured classic baseline is configured.
SEED_CLASSIC = {"detect_s": 60.0, "restart_s": 30.0, "load_s": 60.0}
DEFAULT_DELTA_S = 10.0
MEASURED_SAVES = 200
"""The newest checkpoint events whose medians give δ."""
MEASURED_DRILLS = 1000
"""The newest kill-heal drills whose medians feed the projection."""
DEFAULT_GPUS = (1024, 16384)
MAX_GPUS = 10_000_000
"""The seed's two scales: a large job today, and Llama 3's 16,384 GPUs."""


class Assumptions(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    gpu_mtbf_hours: float = Field(50_000.0, gt=0, le=1e9, description="per-GPU MTBF (Llama 3: ~50,700 h)")
    gpus_per_group: int = Field(8, ge=1, le=MAX_GPUS, description="GPUs one replica group loses when a GPU fails")
    delta_s: float | None = Field(None, gt=0, le=86_400, description="exposed seconds of one checkpoint (Young's "
                                  "interval needs it above 0); default: this job's measured stall per save, "
                                  f"{DEFAULT_DELTA_S:g} s before any save")
    hang_fraction: float = Field(0.017, ge=0, le=1, description="share of failures that are hangs (Llama 3: NCCL "
                                 "watchdog timeouts were 1.7% of interruptions); the rest are crashes")
    state_gb_per_rank: float | None = Field(None, gt=0, le=1e6, description="GB (10^9 bytes) of state a healing rank "
                                            "copies: its shard of the parameters and optimizer state (8B parameters "
                                            "with AdamW over 8 GPUs: ~12); default: what this job's heals moved")
    heal_gb_per_s: float | None = Field(None, gt=0, le=1e6, description="GB/s one rank's heal moves (the link's "
                                        "speed, with this transport); default: what this job's heals measured")


class MeasuredRecovery(BaseModel):
    drills: int
    detect_s: float = Field(description="kill → a survivor's quorum changed (median of the kill-heal drills)")
    hang_drills: int = 0
    hang_detect_s: float | None = Field(None, description="hang → a survivor's quorum changed (median of the hang "
                                        "drills); none run: a hang is assumed to be detected as a crash is")
    reconfigure_s: float = Field(description="detection → survivors commit again (median)")
    rejoin_to_healed_commit_s: float
    heal_transfer_s: float | None = Field(None, description="of the rejoin, the heal's transfer (median)")
    heal_bytes: float | None = Field(None, description="bytes rank 0 of the rejoined group healed (median)")
    survivor_steps_lost: float
    step_s: float | None
    checkpoint_stall_s: float | None = Field(None, description="δ of this service: how long a step waited for a "
                                             "save (median of the newest saves; the copy when written off the step)")
    checkpoint_save_s: float | None = Field(None, description="δ of the classic path, which saves synchronously: "
                                            "the whole save (median)")


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


def measured(store: Store, step_s: float | None) -> MeasuredRecovery:
    reports = [d["report"] for d in store.drills(MEASURED_DRILLS, kind="kill-heal", status="done")]
    hangs = [d["report"]["detect_s"] for d in store.drills(MEASURED_DRILLS, kind="hang", status="done")
             if d["report"].get("detect_s") is not None]
    saves = [e for e in store.newest_events("checkpoint", MEASURED_SAVES)
             if e.action == "saved" and e.stall_s is not None and e.rank == 0]
    if not reports:
        raise NothingMeasured("no kill-heal drill has finished yet: run one (ftctl drill kill-heal --group G) "
                              "so there are recovery times to project")
    return MeasuredRecovery(
        drills=len(reports),
        detect_s=statistics.median(r["detect_s"] for r in reports),
        hang_drills=len(hangs), hang_detect_s=statistics.median(hangs) if hangs else None,
        reconfigure_s=statistics.median(r["survivors_resume_s"] - r["detect_s"] for r in reports),
        rejoin_to_healed_commit_s=statistics.median(r["rejoin_to_healed_commit_s"] for r in reports),
        heal_transfer_s=_median(transfer_s(r) for r in reports if r.get("heal_bytes")),
        heal_bytes=_median(r["heal_bytes"] for r in reports if r.get("heal_bytes")),
        survivor_steps_lost=statistics.median(r["survivors_steps_lost"] for r in reports),
        step_s=step_s, checkpoint_stall_s=_median(s.stall_s for s in saves),
        checkpoint_save_s=_median(s.seconds for s in saves),
    )


def transfer_s(report: dict) -> float:
    """The heal's transfer in a kill-heal report: its recovery phase (the whole fetch in reports
    from before the phases were timed)."""
    timed = [p["seconds"] for p in report.get("recovery", []) if p["phase"] == "transfer"]
    return timed[0] if timed else report["heal_fetch_s"]


def heal_time_s(m: MeasuredRecovery, a: Assumptions) -> float:
    """The rejoin, its transfer scaled to ``a.state_gb_per_rank`` at ``a.heal_gb_per_s`` (each as
    measured where not given): the rest of the rejoin (restart, quorum, apply) as measured."""
    if m.heal_transfer_s is None or not m.heal_bytes:
        return m.rejoin_to_healed_commit_s
    state = a.state_gb_per_rank if a.state_gb_per_rank is not None else m.heal_bytes / 1e9
    rate = a.heal_gb_per_s if a.heal_gb_per_s is not None else m.heal_bytes / 1e9 / max(m.heal_transfer_s, 1e-9)
    return m.rejoin_to_healed_commit_s - m.heal_transfer_s + state / rate


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def classic(path: Path | None) -> tuple[dict[str, float], str]:
    if path is None or not path.is_file():
        return SEED_CLASSIC, "assumed: the seed's scenario C (detect 60 s, restart 30 s, load 60 s)"
    runs = json.loads(path.read_text())["classic"]
    restart = statistics.median(r["kill_to_full_s"] for r in runs)
    load = statistics.median(r["restart_split"]["checkpoint_s"] for r in runs)
    return {"detect_s": 0.0, "restart_s": restart - load, "load_s": load}, f"measured by bench/recovery ({path.name})"


MIN_DELTA_S = 1e-3
"""Young's interval needs δ above 0; a measured stall rounds to no less than a millisecond."""


def _delta(given: float | None, measured_s: float | None) -> float:
    """δ as asked, else as measured, else the default."""
    if given is not None:
        return given
    return DEFAULT_DELTA_S if measured_s is None else max(MIN_DELTA_S, measured_s)


def weighted_detect_s(m: MeasuredRecovery, a: Assumptions) -> float:
    """T_d over the failure mix: crashes detected as the kill-heal drills measured, hangs as the
    hang drills did (as crashes when none ran)."""
    hang = m.hang_detect_s if m.hang_detect_s is not None else m.detect_s
    return (1 - a.hang_fraction) * m.detect_s + a.hang_fraction * hang


def project(m: MeasuredRecovery, classic_times: tuple[dict[str, float], str], gpus: list[int],
            a: Assumptions) -> GoodputOut:
    """At each of ``gpus``, the goodput with the measured recovery and with the classic one.

    Raises :class:`InvalidQuery` when either path makes no progress at a scale."""
    times, source = classic_times
    projections, answer = [], []
    for n in gpus:
        cluster = Cluster(n, a.gpu_mtbf_hours)
        groups = max(1, n // a.gpus_per_group)
        heal_s = heal_time_s(m, a)
        ours = Recovery(detect_s=weighted_detect_s(m, a), restart_s=m.reconfigure_s,
                        load_s=heal_s / groups, delta_s=_delta(a.delta_s, m.checkpoint_stall_s),
                        rollback_s=m.survivor_steps_lost * (m.step_s or 0.0))
        theirs = Recovery(detect_s=times["detect_s"], restart_s=times["restart_s"], load_s=times["load_s"],
                          delta_s=_delta(a.delta_s, m.checkpoint_save_s))
        for label, rec in (("this service (measured)", ours), ("classic restart", theirs)):
            try:
                g = goodput(cluster, rec)
            except NoProgress as err:
                raise InvalidQuery(f"{label} at {n} GPUs: {err}") from None
            projections.append(Projection(path=label, gpus=n, mtbf_h=g.mtbf_s / 3600, tau_s=g.tau_s, goodput=g.goodput,
                                          dominant=g.dominant, loss_per_failure_s=g.loss_per_failure_s, terms=g.terms,
                                          inputs={"detect_s": rec.detect_s, "restart_s": rec.restart_s,
                                                  "load_s": rec.load_s, "delta_s": rec.delta_s,
                                                  "rollback_s": rec.rollback_s if rec.rollback_s is not None else g.tau_s / 2}))
        ours_g, classic_g = projections[-2], projections[-1]
        answer.append(f"at {n} GPUs with our measured recovery (a rejoin of {heal_s:.1f} s), goodput would be "
                      f"{100 * ours_g.goodput:.1f}%, "
                      f"dominant term {ours_g.dominant}; the classic path: {100 * classic_g.goodput:.1f}%, "
                      f"dominant term {classic_g.dominant}")
    return GoodputOut(measured=m, classic_source=source, projections=projections, answer=answer)


def projection(store: Store, step_s: float | None, classic_path: Path | None, gpus: list[int],
               assumptions: Assumptions) -> GoodputOut:
    """The projection from what the store holds: the kill-heal drills and, if given, bench/recovery's JSON."""
    return project(measured(store, step_s), classic(classic_path), gpus, assumptions)
