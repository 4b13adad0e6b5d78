"""The group board on a real SQLite file: the state a command forces never hides newer events."""

from __future__ import annotations

from bench.events import step_fields
from protocol.events import ProcessEvent, StepEvent
from service.controlplane.db import Store
from service.controlplane.groups import GroupBoard

KILL_SENT = 1796398244.2714965
"""Recorded (3 groups, fail-over): the kill was sent at this time; the agent's ``killed`` and
its restart's ``started`` reached the control plane before the agent answered the kill."""


def step(ts: float, step_: int) -> StepEvent:
    return StepEvent(ts=ts, group=0, rank=0, **step_fields(step_, 3, quorum_id=3))


def test_a_forced_kill_answered_after_the_agents_own_restart_does_not_hide_it(tmp_path):
    store = Store(tmp_path / "control.db")
    board = GroupBoard(store, groups=[0])
    board.observe(step(KILL_SENT - 1.0, 30))
    board.observe(ProcessEvent(ts=KILL_SENT + 0.035, group=0, action="killed", pid=7574, returncode=-9))
    board.observe(ProcessEvent(ts=KILL_SENT + 0.036, group=0, action="started", pid=7670, detail="cold start"))
    assert board.force(0, "down", "killed", since=KILL_SENT) is None
    assert board.views[0].state == "starting"
    board.observe(step(KILL_SENT + 9.0, 36))
    assert board.views[0].state == "training"
    restored = GroupBoard(store, groups=[0])
    assert restored.views[0].state == "training", "the store holds what the board showed"


def test_a_forced_state_newer_than_every_event_is_shown_and_stored(tmp_path):
    store = Store(tmp_path / "control.db")
    board = GroupBoard(store, groups=[0])
    board.observe(step(KILL_SENT - 1.0, 30))
    forced = board.force(0, "down", "killed", since=KILL_SENT)
    assert forced is not None and (board.views[0].state, board.views[0].down_reason) == ("down", "killed")
    assert store.transitions(0)[-1] == {"state": "down", "reason": "killed", "ts": KILL_SENT}
