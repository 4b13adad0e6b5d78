"""The recovery timeline on recorded event streams: no processes, the events real drills received.

tests/recorded/*.json were recorded by tests/recorded/record.py from real drills on `ftctl up`
(a drill's rejoin, a fail-over to a warm spare, three groups, a chaos drill); each holds the
events in the order the control plane received them and the drill's own report. Replaying them
through :class:`FaultTimeline` must give the report's numbers, and the timeline must say what
it waits for at each point.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from protocol.events import EVENT_ADAPTER, Event, FingerprintEvent, ProcessEvent, StartEvent, StepEvent
from service.controlplane.drills.kill_heal import KillHealReport, fill_report
from service.controlplane.drills.timeline import FaultTimeline, Milestone
from service.controlplane.groups import GroupView, Transition, next_state

RECORDED = Path(__file__).parents[1] / "recorded"
KILL_HEALS = ("kill_heal_rejoined_by_drill", "kill_heal_failover_to_spare", "kill_heal_three_groups")


def recording(name: str) -> dict:
    return json.loads((RECORDED / f"{name}.json").read_text())


def events_of(rec: dict) -> list[Event]:
    return [EVENT_ADAPTER.validate_python(e) for e in rec["events"]]


def views_before(rec: dict) -> dict[int, GroupView]:
    """The groups as the control plane saw them when the drill began."""
    return {int(g): GroupView(int(g), transition=Transition(v["state"], None, 0.0), participants=v["participants"],
                              quorum_id=v["quorum_id"]) for g, v in rec["groups_before"].items()}


def views_at(rec: dict, ts: float) -> dict[int, GroupView]:
    """The groups as the control plane saw them at ``ts``: the recorded events before it folded in."""
    views = views_before(rec)
    for e in events_of(rec):
        if e.ts < ts:
            views[e.group].note(e)
            if (t := next_state(views[e.group].transition, e)) is not None:
                views[e.group].apply(t)
    return views


def begin(rec: dict, group: int, fault_at: float) -> FaultTimeline:
    return FaultTimeline.begin(group, fault_at, views_at(rec, fault_at), rec["ranks_per_group"])


def replay_kill_heal(rec: dict, events: list[Event]) -> FaultTimeline:
    """What the kill-heal drill does: every event once, the drill's rejoin once the survivors resumed."""
    r = rec["drill"]["report"]
    t = begin(rec, r["group"], r["killed_at"])
    for e in events:
        t.observe(e)
        if r["rejoined_by"] == "drill" and t.reached(Milestone.SURVIVORS_RESUMED):
            t.rejoined(r["rejoined_at"], "drill")
    return t


@pytest.mark.parametrize("name", KILL_HEALS)
def test_a_recorded_kill_heal_replays_to_the_drills_own_report(name):
    rec = recording(name)
    expected = rec["drill"]["report"]
    report = KillHealReport(group=expected["group"])
    fill_report(report, replay_kill_heal(rec, events_of(rec)))
    got = report.model_dump()
    for key in ("survivors", "participants_before", "quorum_shrunk_at", "survivors_first_commit_at",
                "survivors_steps_lost", "rejoined_at", "rejoined_by", "heal_started_at", "healed_commit_at",
                "healed_step", "heal_bytes", "detect_s", "survivors_resume_s", "rejoin_to_healed_commit_s",
                "kill_to_full_s", "fingerprint_step", "fingerprints", "fingerprints_equal"):
        assert got[key] == expected[key], key
    assert got["fingerprints_equal"] is True and got["survivors_steps_lost"] <= 1


def test_the_timeline_says_what_it_waits_for_at_each_point():
    rec = recording("kill_heal_rejoined_by_drill")
    r = rec["drill"]["report"]
    t = begin(rec, 1, r["killed_at"])
    said = [t.waiting_for()]
    for e in events_of(rec):
        t.observe(e)
        if t.reached(Milestone.SURVIVORS_RESUMED):
            t.rejoined(r["rejoined_at"], "drill")
        if t.waiting_for() != said[-1]:
            said.append(t.waiting_for())
    assert said == ["a survivor's quorum to drop group 1", "a survivor to commit without group 1",
                    "group 1's ranks to start", "group 1 to heal and commit",
                    "fingerprints from every rank of every group", None]


def test_events_from_before_the_fault_move_nothing():
    rec = recording("kill_heal_rejoined_by_drill")
    r = rec["drill"]["report"]
    t = begin(rec, 1, r["killed_at"])
    for e in events_of(rec):
        if e.ts < r["killed_at"]:
            t.observe(e)
    assert t.waiting_for() == "a survivor's quorum to drop group 1"
    assert t.fingerprints.by_step == {} and t.survivor_steps_lost == 0


def interleave(events: list[Event], rng: random.Random) -> list[Event]:
    """Another arrival order the agents could have produced: each source (a rank's file, an
    agent's process events) keeps its own order, the sources are interleaved at random."""
    sources: dict[tuple, list[Event]] = {}
    for e in events:
        sources.setdefault((e.group, getattr(e, "rank", "agent")), []).append(e)
    queues = list(sources.values())
    out = []
    while queues:
        queue = rng.choice(queues)
        out.append(queue.pop(0))
        queues = [q for q in queues if q]
    return out


@pytest.mark.parametrize("name", KILL_HEALS)
def test_the_arrival_order_between_groups_does_not_change_the_timeline(name):
    """A fail-over can heal the group before the survivors' commit is even received."""
    rec = recording(name)
    r = rec["drill"]["report"]
    events = events_of(rec)
    reference = replay_kill_heal(rec, events)
    for seed in range(20):
        t = begin(rec, r["group"], r["killed_at"])
        if r["rejoined_by"] == "drill":
            t.rejoined(r["rejoined_at"], "drill")
        for e in interleave(events, random.Random(seed)):
            t.observe(e)
        for m in Milestone:
            assert t.reached(m), (seed, m)
        assert (t.detect_s, t.survivors_resume_s, t.kill_to_full_s, t.healed_step, t.survivor_steps_lost,
                t.fingerprint_step, t.rejoined_by) == (
            reference.detect_s, reference.survivors_resume_s, reference.kill_to_full_s, reference.healed_step,
            reference.survivor_steps_lost, reference.fingerprint_step, reference.rejoined_by), seed


def test_a_replacement_that_never_starts_leaves_the_timeline_waiting_for_it():
    rec = recording("kill_heal_rejoined_by_drill")
    r = rec["drill"]["report"]
    t = begin(rec, 1, r["killed_at"])
    t.rejoined(r["rejoined_at"], "drill")
    for e in events_of(rec):
        if e.group != 1 or isinstance(e, ProcessEvent):
            t.observe(e)
    assert t.reached(Milestone.SURVIVORS_RESUMED) and not t.reached(Milestone.REPLACEMENT_UP)
    assert t.waiting_for() == "group 1's ranks to start"
    assert t.heal_s is None and t.kill_to_full_s is None


def test_fingerprints_that_differ_are_reported_unequal():
    rec = recording("kill_heal_three_groups")
    r = rec["drill"]["report"]
    t = begin(rec, r["group"], r["killed_at"])
    t.rejoined(r["rejoined_at"], "drill")
    for e in events_of(rec):
        if isinstance(e, FingerprintEvent) and e.group == r["group"]:
            e = e.model_copy(update={"digest": "0" * 16})
        t.observe(e)
    assert t.fingerprint_step == r["fingerprint_step"]
    assert t.fingerprints.equal_at(t.fingerprint_step) is False


def test_a_recorded_chaos_drill_replays_to_its_kills():
    """The chaos drill's observer: one timeline per kill, each closed once healed and rejoined."""
    rec = recording("chaos_two_groups")
    kills = rec["drill"]["report"]["kills"]
    assert len(kills) >= 2
    events = events_of(rec)
    for kill in kills:
        t = begin(rec, kill["group"], kill["killed_at"])
        for e in events:
            if t.reached(Milestone.HEALED) and t.reached(Milestone.REJOINED):
                break
            if kill["rejoined_at"] <= e.ts:
                t.rejoined(kill["rejoined_at"], "drill")
            t.observe(e)
        assert (t.detect_s, t.restart_s, t.heal_s, t.survivor_steps_lost) == (
            kill["detect_s"], kill["restart_s"], kill["heal_s"], kill["survivor_steps_lost"])
        assert t.up_at == kill["started_at"] and t.healed_commit_at == kill["healed_commit_at"]


def test_a_survivor_step_in_the_old_quorum_is_not_a_resume():
    rec = recording("kill_heal_rejoined_by_drill")
    r = rec["drill"]["report"]
    t = begin(rec, 1, r["killed_at"])
    old = next(e for e in events_of(rec) if isinstance(e, StepEvent) and e.group == 0 and e.rank == 0
               and e.ts < r["killed_at"])
    t.observe(old.model_copy(update={"ts": r["killed_at"] + 0.01}))  # same quorum, both groups: not resumed
    assert not t.reached(Milestone.SURVIVORS_RESUMED)


def test_a_group_that_waited_through_a_cut_returns_at_the_mend_and_its_late_steps_from_before_do_not_count():
    """The partition drill's isolated group: its ranks never ended, so no start event; it is back
    once the cut is mended. A step it failed during the cut, shipped late by its agent, is not
    its healed commit."""
    rec = recording("kill_heal_rejoined_by_drill")
    r = rec["drill"]["report"]
    t = begin(rec, 1, r["killed_at"])
    mended = r["rejoined_at"]
    t.returned(mended)
    stale = next(e for e in events_of(rec) if isinstance(e, StepEvent) and e.group == 1 and e.rank == 0
                 and e.committed and e.ts < r["killed_at"])
    t.observe(stale.model_copy(update={"ts": (r["killed_at"] + mended) / 2}))
    assert not t.reached(Milestone.HEALED)
    for e in events_of(rec):
        if not (e.group == 1 and isinstance(e, (ProcessEvent, StartEvent))):
            t.observe(e)
    assert (t.rejoined_by, t.rejoined_at, t.up_at) == ("network", mended, mended)
    assert t.healed_commit_at == r["healed_commit_at"] and t.fingerprint_step == r["fingerprint_step"]
