"""Prometheus metrics of the control plane: what the events say about the job.

Counters and histograms move as events arrive; gauges are read from the group board and the
store when Prometheus scrapes. One prefix (``ftctl_``), base units, ``_total`` counters, and
labels of low cardinality: the stable group id, never torchft's per-start replica uuid. Every
label value known in advance (each group, each exit reason, each drill kind and outcome) is
there from the start at 0, so ``increase()`` sees the first kill instead of a new series.

A group costs a fixed number of series from when it is known (the README states it, a test
counts it): at a thousand groups ``/metrics`` is what Prometheus stores, so per-group durations
are summaries (sum and count: the mean the dashboards draw), and the distributions with buckets
(heal, checkpoint) are job-wide.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protocol.events import (
    CheckpointEvent,
    Event,
    ExitKind,
    FingerprintEvent,
    HealEvent,
    PartitionEvent,
    ProcessEvent,
    QuorumEvent,
    SdcEvent,
    StartEvent,
    StepEvent,
    StragglerEvent,
    SyncEvent,
    Verdict,
    speaks_for_group,
)
from protocol.ingest import Transport
from service.controlplane.db import Store
from service.controlplane.drills import DRILLS, FAULT_CLASSES
from service.controlplane.errors import DomainError
from service.controlplane.fingerprints import FingerprintBook
from service.controlplane.goodput import GoodputOut, Projection
from service.controlplane.groups import STATES, GroupBoard
from service.controlplane.recovery import PHASES, recovery_phases
from service.controlplane.stragglers import Pattern, StragglerTracker

CODES = ("unknown", *STATES)  # dashboards/quorum.py maps these numbers back to names
HEAL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10)
DRILL_OUTCOMES = ("done", "failed", "cancelled")
FINGERPRINT_STEPS = 20
"""Steps of fingerprints kept to compare: groups report the same step within seconds."""


class JobMetrics:
    def __init__(self, groups: Iterable[int]) -> None:
        disable_created_metrics()  # a ``_created`` series beside each counter: a quarter of a group's series, unused
        self.registry = CollectorRegistry()
        r = self.registry
        self.compute = Summary("ftctl_step_compute_seconds", "rank 0's compute time per step", ["group"], registry=r)
        self.allreduce = Summary("ftctl_step_allreduce_wait_seconds",
                                 "rank 0's wait on the cross-group all-reduce per step", ["group"], registry=r)
        self.commits = Counter("ftctl_commits_total", "steps a group committed", ["group"], registry=r)
        self.commit_failures = Counter("ftctl_commit_failures_total", "steps a group could not commit", ["group"],
                                       registry=r)
        self.heals = Counter("ftctl_heals_total", "heals from a live peer", ["group"], registry=r)
        self.heal_seconds = Histogram("ftctl_heal_duration_seconds", "fetch + load time of a heal (rank 0), every "
                                      "group's", buckets=HEAL_BUCKETS, registry=r)
        self.heal_phases = Histogram("ftctl_heal_phase_seconds", "a group's return (rank 0), phase by phase, from its "
                                     "restart to its first committed step after the heal (phases named in "
                                     "service/controlplane/recovery.py; verify is a part of transfer)", ["phase"],
                                     buckets=HEAL_BUCKETS, registry=r)
        for phase in PHASES:
            self.heal_phases.labels(phase)
        self._returns: dict[int, _Return] = {}
        self.heal_bytes = Counter("ftctl_heal_bytes_total", "bytes rank 0 of a group copied from peers", ["group"],
                                  registry=r)
        self.starts = Counter("ftctl_group_starts_total", "times a group's processes were started (rejoins included)",
                              ["group"], registry=r)
        self.exits = Counter("ftctl_group_exits_total", "times a group went down, by reason", ["group", "reason"],
                             registry=r)
        self.quorum_changes = Counter("ftctl_quorum_changes_total", "quorum changes seen by a group's rank 0",
                                      ["group"], registry=r)
        self.checkpoint_seconds = Histogram("ftctl_checkpoint_save_seconds", "checkpoint save time, start to "
                                            "published (mostly in the background when written off the step)",
                                            buckets=HEAL_BUCKETS, registry=r)
        self.checkpoint_stall = Histogram("ftctl_checkpoint_stall_seconds", "how long a training step waited for "
                                          "a checkpoint save: its copy into CPU memory when written off the step",
                                          buckets=STALL_BUCKETS, registry=r)
        self.stragglers = Counter("ftctl_stragglers_flagged_total", "times the detector flagged a group as a "
                                  "persistent straggler", ["group"], registry=r)
        self.sdc_incidents = Counter("ftctl_sdc_incidents_total", "gradients the check found abnormal, by the group "
                                     "and the reruns' verdict", ["group", "verdict"], registry=r)
        self.skipped_steps = Counter("ftctl_steps_skipped_total", "steps a group committed without an optimizer step: "
                                     "a gradient failed the check", ["group"], registry=r)
        self.grad_norm = Gauge("ftctl_gradient_norm", "the group's own gradient norm at its last step, before it "
                               "crossed groups (NaN: not finite)", ["group"], registry=r)
        self.syncs = Counter("ftctl_syncs_total", "syncs across groups (--sync localsgd|diloco) groups' rank 0 "
                             "took part in, by result (skipped: the pseudo-gradient check found the window's samples abnormal)", ["result"], registry=r)
        for result in ("committed", "failed", "skipped"):
            self.syncs.labels(result)
        self.sync_seconds = Histogram("ftctl_sync_duration_seconds", "a sync across groups (rank 0 of every group): "
                                      "waiting for the others, the quorum, a heal, the all-reduce of the "
                                      "pseudo-gradients, the outer step", buckets=HEAL_BUCKETS, registry=r)
        self.sync_bytes = Counter("ftctl_sync_bytes_total", "pseudo-gradient bytes groups' rank 0 sent into syncs' "
                                  "all-reduces", registry=r)
        self.drift = Gauge("ftctl_sync_drift", "norm of the group's pseudo-gradient at its last sync: how far its "
                           "window moved it from the last synced parameters", ["group"], registry=r)
        self.partitions = Counter("ftctl_partition_actions_total", "groups the control plane evicted because they did "
                                  "not reach other groups (a partition), and rejoined once they did", ["action"],
                                  registry=r)
        for action in get_args(PartitionEvent.model_fields["action"].annotation):
            self.partitions.labels(action)
        self.events = Counter("ftctl_events_received_total", "events accepted from agents", registry=r)
        self.batches = Counter("ftctl_ingest_batches_total", "event batches agents handed in, by how: on their "
                               "stream (a WebSocket) or by POST", ["transport"], registry=r)
        for transport in get_args(Transport):
            self.batches.labels(transport)
        self.last_checkpoint_ts = 0.0
        self.fingerprints = FingerprintBook(keep_steps=FINGERPRINT_STEPS)
        self.fingerprint_mismatch = 0.0
        self.per_group = (self.compute, self.allreduce, self.commits, self.commit_failures, self.heals,
                          self.heal_bytes, self.starts, self.quorum_changes, self.stragglers, self.skipped_steps)
        self._children: dict[int, dict] = {}
        for g in groups:
            self.ensure(g)

    def ensure(self, group: int) -> None:
        """Every series of a group exists from when it is known, at zero: a rate over it starts there."""
        if group in self._children:
            return
        g = str(group)
        self._children[group] = {metric: metric.labels(g) for metric in self.per_group}
        for reason in get_args(ExitKind):
            self.exits.labels(g, reason)
        for verdict in get_args(Verdict):
            self.sdc_incidents.labels(g, verdict)

    def observe(self, e: Event) -> None:
        """Each event moves its group's series (looked up once per group, not per event: a
        thousand groups send five thousand events a second)."""
        self.ensure(e.group)
        g, of = str(e.group), self._children[e.group]
        self.events.inc()
        match e:
            case ProcessEvent(action="started"):
                of[self.starts].inc()
                self._returns[e.group] = _Return(rejoined_at=e.ts)
            case ProcessEvent(action=reason):
                self.exits.labels(g, reason).inc()
            case FingerprintEvent():
                self._fingerprint(e)
            case StragglerEvent(action="flagged"):
                of[self.stragglers].inc()
            case PartitionEvent():
                self.partitions.labels(e.action).inc()
            case SdcEvent():
                self.sdc_incidents.labels(g, e.verdict).inc()
            case _ if not speaks_for_group(e):
                pass
            case StartEvent():
                self._returns.setdefault(e.group, _Return()).start = e
            case StepEvent():
                self._first_commit(e)
                of[self.compute].observe(e.compute_s)
                of[self.allreduce].observe(e.allreduce_s)
                of[self.commits if e.committed else self.commit_failures].inc()
                if e.skipped:
                    of[self.skipped_steps].inc()
                if e.grad_norm is not None or e.skipped:
                    self.grad_norm.labels(g).set(e.grad_norm if e.grad_norm is not None else math.nan)
            case SyncEvent():
                self.syncs.labels("committed" if e.committed else "skipped" if e.skipped else "failed").inc()
                self.sync_seconds.observe(e.seconds)
                self.sync_bytes.inc(e.bytes)
                if e.drift is not None:
                    self.drift.labels(g).set(e.drift)
            case HealEvent():
                of[self.heals].inc()
                self.heal_seconds.observe(e.fetch_s + e.load_s)
                self._heal_phases(e)
                of[self.heal_bytes].inc(e.bytes)
            case QuorumEvent():
                of[self.quorum_changes].inc()
            case CheckpointEvent(action="saved"):
                self.checkpoint_seconds.observe(e.seconds)
                if e.stall_s is not None:
                    self.checkpoint_stall.observe(e.stall_s)
                self.last_checkpoint_ts = max(self.last_checkpoint_ts, e.ts)

    def _heal_phases(self, e: HealEvent) -> None:
        back = self._returns.setdefault(e.group, _Return())
        for phase in recovery_phases(back.rejoined_at, back.start, e):
            self.heal_phases.labels(phase.phase).observe(max(0.0, phase.seconds))
        back.applied_at = e.applied_at

    def _first_commit(self, e: StepEvent) -> None:
        """A return ends at the group's first committed step (right after its heal's event)."""
        back = self._returns.get(e.group)
        if e.committed and back is not None and back.start is not None:
            if back.applied_at is not None:
                self.heal_phases.labels("first_commit").observe(max(0.0, e.ts - back.applied_at))
            del self._returns[e.group]

    def _fingerprint(self, e: FingerprintEvent) -> None:
        """At each step every reporting (group, rank) is compared with the other groups' same rank."""
        self.fingerprints.add(e)
        if len(self.fingerprints.groups_at(e.step)) > 1:
            self.fingerprint_mismatch = float(not self.fingerprints.equal_at(e.step))


@dataclass
class _Return:
    """A group's way back, as far as its events have told it (``recovery.recovery_phases``)."""

    rejoined_at: float | None = None
    start: StartEvent | None = None
    applied_at: float | None = None


@dataclass(frozen=True)
class StoredNumbers:
    """What the gauges read from SQLite: read in a worker thread before each scrape (the store's
    lock is the writer's too, so reading it on the event loop would wait for a batch's commit)."""

    ingest: dict[int, dict]
    drill_counts: dict[tuple[str, str], int]
    last_done: dict[str, dict]
    """The newest finished drill's report of each kind that has one."""
    projections: list[Projection]
    coverage: dict[str, int]
    """The data coverage's totals (``service/controlplane/coverage.py``)."""


class StateCollector:
    """Gauges read at scrape time from the board, and from the store as last read by ``refresh``."""

    def __init__(self, board: GroupBoard, store: Store, metrics: JobMetrics, stragglers: StragglerTracker,
                 project: Callable[[], GoodputOut]):
        """``project()`` raises a DomainError when there is nothing to project yet."""
        self.board = board
        self.store = store
        self.metrics = metrics
        self.stragglers = stragglers
        self.project = project
        self.stored = self._read_store()

    def refresh(self) -> None:
        """Reads the store again (blocking: call it in a worker thread)."""
        self.stored = self._read_store()

    def _read_store(self) -> StoredNumbers:
        try:
            projections = self.project().projections
        except DomainError:  # no drill measured yet, or the model says no progress at that scale
            projections = []
        last_done = {kind: rows[0]["report"] or {} for kind in DRILLS
                     if (rows := self.store.drills(1, kind=kind, status="done"))}
        return StoredNumbers(self.store.ingest_stats(), self.store.drill_counts(), last_done, projections,
                             self.store.coverage_totals())

    def collect(self):
        views = self.board.views.values()
        state = GaugeMetricFamily("ftctl_group_state", "1 for the state the group is in", labels=["group", "state"])
        code = GaugeMetricFamily("ftctl_group_state_code",
                                 "the group's state as a number: " + ", ".join(f"{i} {n}" for i, n in enumerate(CODES)),
                                 labels=["group"])
        up = GaugeMetricFamily("ftctl_group_up", "1 while the group is not down", labels=["group"])
        step = GaugeMetricFamily("ftctl_group_step", "last committed step", labels=["group"])
        lag = GaugeMetricFamily("ftctl_group_step_lag", "steps behind the most advanced group", labels=["group"])
        loss = GaugeMetricFamily("ftctl_group_loss", "last committed loss (NaN: not finite, the training diverged)",
                                 labels=["group"])
        parts = GaugeMetricFamily("ftctl_group_participants", "groups in the quorum this group trains in",
                                  labels=["group"])
        quorum = GaugeMetricFamily("ftctl_group_quorum_id", "the quorum this group trains in (its rank 0's last "
                                   "step; the Lighthouse's own is ftctl_lighthouse_quorum_id)", labels=["group"])
        steps = [v.step for v in views if v.step is not None]
        top = max(steps) if steps else 0
        for v in views:
            g = str(v.group)
            for s in STATES:
                state.add_metric([g, s], 1.0 if v.state == s else 0.0)
            code.add_metric([g], CODES.index(v.state))
            up.add_metric([g], 1.0 if v.up else 0.0)
            if v.step is not None:
                step.add_metric([g], v.step)
                lag.add_metric([g], top - v.step)
            if v.step is not None:
                loss.add_metric([g], math.nan if v.diverged else v.loss)
            if v.participants is not None:
                parts.add_metric([g], v.participants)
            if v.quorum_id is not None:
                quorum.add_metric([g], v.quorum_id)
        yield from (state, code, up, step, lag, loss, parts, quorum)
        yield from self._stragglers()
        yield GaugeMetricFamily("ftctl_fingerprint_mismatch",
                                "1 when groups reported different state fingerprints at the same step",
                                value=self.metrics.fingerprint_mismatch)
        yield GaugeMetricFamily("ftctl_checkpoint_last_save_timestamp_seconds", "when the newest checkpoint was saved",
                                value=self.metrics.last_checkpoint_ts)
        yield from self._ingest()
        yield from self._drills()
        yield from self._coverage()

    def _coverage(self):
        c = self.stored.coverage
        samples = CounterMetricFamily("ftctl_samples", "samples of the global batches committed steps used up, by "
                                      "outcome (they add up to the samples planned)", labels=["outcome"])
        for outcome, key in (("trained_once", "once"), ("trained_twice", "twice"), ("skipped", "skipped")):
            samples.add_metric([outcome], c[key])
        yield samples

    def _ingest(self):
        """What the store counted of each group's events, so a restart keeps the counts."""
        families = {
            "agent_dropped": CounterMetricFamily("ftctl_events_dropped", "events an agent gave up on: its buffer was "
                                                 "full, or the control plane refused their batch (as the agent counts "
                                                 "them)", labels=["group"]),
            "rejected": CounterMetricFamily("ftctl_events_rejected", "events refused as invalid (one line of why in "
                                            "the ingest answer)", labels=["group"]),
            "duplicates": CounterMetricFamily("ftctl_events_duplicate", "events sent again (a retry, a re-read) and "
                                              "stored only once", labels=["group"]),
        }
        stats = self.stored.ingest
        for g in self.board.views:
            for key, family in families.items():
                family.add_metric([str(g)], stats.get(g, {}).get(key, 0))
        yield from families.values()

    def _stragglers(self):
        """Every group has its flag; the ratios exist for the groups in the detector's last verdict."""
        t = self.stragglers
        flagged = GaugeMetricFamily("ftctl_straggler", "1 while the detector flags the group as a persistent "
                                    "straggler", labels=["group"])
        for g in self.board.views:
            flagged.add_metric([str(g)], 1.0 if g == t.flagged else 0.0)
        slowdown = GaugeMetricFamily("ftctl_straggler_slowdown_ratio", "the group's median compute over its peers' "
                                     "median, over the detector's window", labels=["group"])
        scores = GaugeMetricFamily("ftctl_straggler_score_ratio", "NVRx-style scores: relative (fastest group's "
                                   "median over this one's), individual (its best median over its current one)",
                                   labels=["group", "score"])
        for g, s in t.verdict.scores.items():
            slowdown.add_metric([str(g)], s.slowdown)
            scores.add_metric([str(g), "relative"], s.relative)
            scores.add_metric([str(g), "individual"], s.individual)
        pattern = GaugeMetricFamily("ftctl_straggler_pattern", "1 for the detector's current verdict: none, "
                                    "persistent (one group) or rotating (the slow group changes)", labels=["pattern"])
        for name in get_args(Pattern):
            pattern.add_metric([name], 1.0 if t.verdict.pattern == name else 0.0)
        yield from (flagged, slowdown, scores, pattern)

    def _fault_classes(self):
        detect = GaugeMetricFamily("ftctl_fault_detect_seconds", "the last drill of each fault class: fault → "
                                   "detected (NaN: not drilled yet)", labels=["fault"])
        resume = GaugeMetricFamily("ftctl_fault_resume_seconds", "the last drill of each fault class: fault → the "
                                   "other groups commit again (lighthouse: the longest gap in a group's commits)",
                                   labels=["fault"])
        for fault, drill in FAULT_CLASSES.items():  # detection is every report's detect_s
            report = self.stored.last_done.get(drill.kind, {})
            for family, key in ((detect, "detect_s"), (resume, drill.fault_class.resume_key)):
                value = report.get(key)
                family.add_metric([fault], float("nan") if value is None else value)
        yield detect
        yield resume

    def _drills(self):
        counts = self.stored.drill_counts
        finished = CounterMetricFamily("ftctl_drills", "drills finished, by kind and outcome", labels=["kind", "status"])
        for kind in DRILLS:
            for outcome in DRILL_OUTCOMES:
                finished.add_metric([kind, outcome], counts.get((kind, outcome), 0))
        yield finished
        yield GaugeMetricFamily("ftctl_drills_running", "1 while a drill runs",
                                value=sum(n for (_, status), n in counts.items() if status == "running"))
        heal = self.stored.last_done.get("kill-heal")
        result = GaugeMetricFamily("ftctl_drill_seconds", "the last kill-heal drill's measured times", labels=["phase"])
        if heal:
            for phase, key in (("detect", "detect_s"), ("survivors_resume", "survivors_resume_s"),
                               ("heal", "rejoin_to_healed_commit_s")):
                result.add_metric([phase], heal[key])
        yield result
        yield GaugeMetricFamily("ftctl_drill_fingerprints_equal", "1 if the last kill-heal drill found equal state",
                                value=float(bool(heal.get("fingerprints_equal"))) if heal else float("nan"))
        yield from self._fault_classes()
        chaos = self.stored.last_done.get("chaos")
        yield GaugeMetricFamily("ftctl_goodput_ratio", "the last chaos drill's goodput (committed rate vs failure-free)",
                                value=chaos["goodput"] if chaos and chaos.get("goodput") is not None else float("nan"))
        projected = GaugeMetricFamily("ftctl_goodput_projected_ratio",
                                      "the ledger's goodput at scale with the measured recovery (GET /goodput)",
                                      labels=["gpus", "path"])
        for p in self.stored.projections:
            projected.add_metric([str(p.gpus), "torchft" if p.path.startswith("this service") else "classic"],
                                 p.goodput)
        yield projected
