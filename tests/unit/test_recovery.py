"""A group's return, phase by phase, from the events its rank 0 writes: the phases are the gaps
between consecutive instants, so they add up to restart → first commit; a warm spare's start
counts from its promotion; a heal without a restart (or from an older trainer) shows what it can."""

from __future__ import annotations

import pytest

from bench.events import start_fields
from protocol.events import HealEvent, StartEvent
from service.controlplane.recovery import PHASES, recovery_phases, total_s

REJOINED, UP, QUORUM, FETCH, APPLIED, COMMITTED = 100.0, 106.0, 106.5, 106.6, 109.5, 109.9


def start(**overrides) -> StartEvent:
    return StartEvent(group=1, rank=0, ts=UP, **start_fields(**overrides))


def heal(**overrides) -> HealEvent:
    fields = dict(step=40, source_group=0, sources=[0, 2], bytes=3 * 2**30, quorum_at=QUORUM, fetch_started_at=FETCH,
                  header_s=0.1, transfer_s=2.0, checksum_s=0.25, fetch_s=2.1, load_s=0.4, applied_at=APPLIED)
    return HealEvent(group=1, rank=0, ts=COMMITTED, **{**fields, **overrides})


def seconds(phases) -> dict[str, float]:
    return {p.phase: round(p.seconds, 6) for p in phases}


def test_a_cold_return_is_accounted_for_to_the_second():
    phases = recovery_phases(REJOINED, start(), heal(), COMMITTED)
    assert [p.phase for p in phases] == list(PHASES)
    assert total_s(phases) == pytest.approx(COMMITTED - REJOINED)
    assert seconds(phases) == {"process_start": 2.0, "process_group": 1.0, "data": 1.0, "model_build": 1.0,
                               "checkpoint_lookup": 0.0, "manager": 1.0, "quorum_wait": 0.5, "metadata": 0.2,
                               "transfer": 2.0, "verify": 0.25, "healing_step": 0.4, "apply": 0.4, "first_commit": 0.4}
    transfer = next(p for p in phases if p.phase == "transfer")
    assert transfer.detail == "3072.0 MiB at 1.50 GiB/s from group(s) 0, 2"
    assert next(p for p in phases if p.phase == "verify").within == "transfer"


def test_a_promoted_spare_counts_from_its_promotion():
    phases = recovery_phases(REJOINED, start(spare_wait_s=600.0, forked=False), heal(), COMMITTED)
    assert [p.phase for p in phases][:3] == ["process_start", "manager", "quorum_wait"]
    assert seconds(phases)["process_start"] == 5.0 and "warm spare" in phases[0].detail
    assert total_s(phases) == pytest.approx(COMMITTED - REJOINED)


def test_what_is_not_known_is_not_shown():
    assert recovery_phases(REJOINED, None, None) == []
    no_times = recovery_phases(REJOINED, start(), heal(quorum_at=None, fetch_started_at=None, applied_at=None))
    assert [p.phase for p in no_times] == ["process_start", "process_group", "data", "model_build",
                                           "checkpoint_lookup", "manager"]
    never_restarted = recovery_phases(None, None, heal(), COMMITTED)
    assert [p.phase for p in never_restarted] == ["metadata", "transfer", "verify", "healing_step", "apply",
                                                  "first_commit"]
    assert total_s(never_restarted) == pytest.approx(COMMITTED - QUORUM)
