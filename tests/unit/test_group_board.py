"""The group board on a real SQLite file, written by events only: the control plane's own
commands (kill, evict, rejoin) and verdicts (lost) reach it through the same ingest path as the
agents' events, and an event both sides send (the command's answer and the agent's forwarder
carry the same ``eid``) is stored once."""

from __future__ import annotations

import time

from bench.events import step_event
from protocol.events import ProcessEvent, StepEvent
from protocol.ingest import IngestBatch
from service.controlplane.bus import EventBus
from service.controlplane.coverage import CoverageLedger
from service.controlplane.db import Store
from service.controlplane.groups import GroupBoard
from service.controlplane.ingest import Ingestor
from service.controlplane.metrics import JobMetrics
from service.controlplane.stragglers import StragglerTracker

KILL_SENT = 1796398244.2714965
"""Recorded (3 groups, fail-over): the kill was sent at this time; the agent's ``killed`` and
its restart's ``started`` reached the control plane before the agent answered the kill."""


def ingestor(store: Store) -> Ingestor:
    board = GroupBoard(store, groups=[0])
    return Ingestor(store, board, JobMetrics(board.views), EventBus(16), StragglerTracker(10, 1.15, "flag"),
                    max_clock_skew_s=5.0, max_event_age_s=10 * 365 * 86400, coverage=CoverageLedger(store))


def step(ts: float, step_: int) -> StepEvent:
    return step_event(0, step_, ts, 3, quorum_id=3)


def killed(ts: float) -> ProcessEvent:
    return ProcessEvent(ts=ts, group=0, eid="g0-agent:41", action="killed", pid=7574, returncode=-9)


def forwarded(ingest: Ingestor, *events) -> int:
    """The agent's forwarder's batch, checked and stored as the ingest route does; events stored."""
    checked = ingest.check_batch(0, IngestBatch(events=[e.model_dump(mode="json") for e in events]))
    assert not checked.reasons, checked.reasons
    return len(ingest.commit([checked])[0])


def test_a_kill_answered_after_the_agents_own_restart_does_not_hide_it(tmp_path):
    store = Store(tmp_path / "control.db")
    ingest = ingestor(store)
    ingest.record([step(KILL_SENT - 1.0, 30)])
    restarted = ProcessEvent(ts=KILL_SENT + 0.036, group=0, eid="g0-agent:42", action="started", pid=7670,
                             detail="cold start")
    assert forwarded(ingest, killed(KILL_SENT + 0.035), restarted) == 2
    assert ingest.record([killed(KILL_SENT + 0.035)]) == 0, "the kill's answer carries the same event: a duplicate"
    assert ingest.board.views[0].state == "starting"
    ingest.record([step(KILL_SENT + 9.0, 36)])
    assert ingest.board.views[0].state == "training"
    assert GroupBoard(store, groups=[0]).views[0].state == "training", "the store holds what the board showed"
    assert [e["action"] for e in store.events(0, ["process"])] == ["killed", "started"]


def test_a_kill_answered_before_its_event_is_forwarded_shows_down_once(tmp_path):
    store = Store(tmp_path / "control.db")
    ingest = ingestor(store)
    ingest.record([step(KILL_SENT - 1.0, 30)])
    assert ingest.record([killed(KILL_SENT + 0.035)]) == 1
    view = ingest.board.views[0]
    assert (view.state, view.down_reason) == ("down", "killed")
    assert forwarded(ingest, killed(KILL_SENT + 0.035)) == 0, "the forwarder's copy is a duplicate"
    assert store.transitions(0)[-1] == {"state": "down", "reason": "killed", "ts": KILL_SENT + 0.035}
    assert len(store.transitions(0)) == 2


def test_a_lost_group_that_speaks_again_is_up_by_its_own_events_and_old_ones_do_not_lift_it(tmp_path):
    """Lost is the control plane's inference from silence; the group's word after it is the truth."""
    ingest = ingestor(Store(tmp_path / "control.db"))
    now = time.time()
    ingest.record([step(now - 5.0, 30)])
    ingest.record([ProcessEvent(ts=now - 3.0, group=0, action="lost", detail="its agent stopped answering")])
    assert forwarded(ingest, step(now - 4.0, 31)) == 1
    assert (ingest.board.views[0].state, ingest.board.views[0].down_reason) == ("down", "lost"), \
        "a step from before the verdict does not lift it"
    assert forwarded(ingest, step(now - 1.0, 32)) == 1
    assert ingest.board.views[0].state == "training"
