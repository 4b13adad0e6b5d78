"""The goodput model of long-running training (the seed, chapter 2; no torch import).

    cluster MTBF          M = per-GPU MTBF / N
    loss per failure      L = T_d + T_r + T_l + tau / 2      (rollback: half an interval;
                                                          with torchft a survivor redoes ~1 step)
    goodput               G = (1 - L / M) / (1 + delta / tau)
    Young's interval      tau_opt = sqrt(2 * delta * M)

T_d detection, T_r restart, T_l load (or heal), delta the exposed cost of one checkpoint,
tau the checkpoint interval. Each term's share of wall-clock time says which one to shrink.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

HOUR = 3600.0
SHOWN_INTERVALS_MIN = (2, 5, 10, 15, 30, 60)
"""Fixed checkpoint intervals a sweep shows beside Young's: from aggressive to hourly."""


class NoProgress(ValueError):
    """The loss per failure reaches the cluster MTBF: the job never gets anywhere."""


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_mtbf_hours: float

    @property
    def mtbf_s(self) -> float:
        return self.gpu_mtbf_hours * HOUR / self.gpus


@dataclass(frozen=True)
class Recovery:
    detect_s: float
    restart_s: float
    load_s: float
    delta_s: float
    rollback_s: float | None = None  # None: tau/2 (restart from a checkpoint); torchft: about one step


@dataclass(frozen=True)
class Goodput:
    gpus: int
    mtbf_s: float
    tau_s: float
    goodput: float
    checkpoint_overhead: float
    loss_per_failure_s: float
    terms: dict[str, float]
    dominant: str

    def as_dict(self) -> dict:
        return asdict(self)


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """tau_opt = sqrt(2 delta M): minimises delta/tau + tau/(2M)."""
    return math.sqrt(2.0 * delta_s * mtbf_s)


def goodput(cluster: Cluster, rec: Recovery, tau_s: float | None = None) -> Goodput:
    m = cluster.mtbf_s
    tau = tau_s if tau_s is not None else young_interval(rec.delta_s, m)
    if tau <= 0:
        raise ValueError("the checkpoint interval tau must be positive (give --tau, or a positive --delta)")
    rollback = tau / 2.0 if rec.rollback_s is None else rec.rollback_s
    loss = rec.detect_s + rec.restart_s + rec.load_s + rollback
    if loss >= m:
        raise NoProgress(f"loss per failure {loss:.0f} s >= cluster MTBF {m:.0f} s: training never makes progress")
    overhead = rec.delta_s / tau
    g = (1.0 - loss / m) / (1.0 + overhead)
    terms = {
        "checkpoint": g * overhead,
        "detect": rec.detect_s / m,
        "restart": rec.restart_s / m,
        "load": rec.load_s / m,
        "rollback": rollback / m,
    }
    return Goodput(cluster.gpus, m, tau, g, overhead, loss, terms, max(terms, key=terms.get))


def sweep(cluster: Cluster, rec: Recovery, taus_min: tuple[float, ...] = SHOWN_INTERVALS_MIN) -> list[Goodput]:
    """The Young-optimal interval first, then fixed intervals (those that make progress)."""
    out = [goodput(cluster, rec)]
    for minutes in taus_min:
        try:
            out.append(goodput(cluster, rec, tau_s=minutes * 60))
        except NoProgress:
            pass
    return out


def describe(g: Goodput) -> str:
    t = g.terms
    return (f"{g.mtbf_s / HOUR:8.2f} h  tau {g.tau_s / 60:6.1f} min  goodput {100 * g.goodput:6.2f}%  "
            f"| ckpt {100 * t['checkpoint']:5.2f}  detect {100 * t['detect']:5.2f}  restart {100 * t['restart']:5.2f}  "
            f"load {100 * t['load']:5.2f}  rollback {100 * t['rollback']:5.2f}  | dominant: {g.dominant}")
