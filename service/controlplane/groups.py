"""Each replica group's state machine, driven by the events its agent and ranks send.

    starting ──start──▶ joining ──heal──▶ healing ──committed step──▶ training
        ▲                   └──────────committed step──────────────────▲
        └── process started ── down (killed | crashed | stopped | finished) ◀── process exit

Trainer events are read from files and can arrive after the agent's report that the group
died; an event older than the current state's entry time never moves the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

State = Literal["starting", "joining", "healing", "training", "down"]
DownReason = Literal["killed", "crashed", "stopped", "finished"]
STATES: tuple[str, ...] = ("starting", "joining", "healing", "training", "down")


@dataclass
class Transition:
    state: State
    reason: str | None
    ts: float


def next_state(current: Transition | None, event: dict) -> Transition | None:
    """The transition ``event`` causes from ``current``, or None."""
    ts = event["ts"]
    if current is not None and ts < current.ts:
        return None
    kind = event["type"]
    target: tuple[State, str | None] | None = None
    if kind == "process":
        target = ("starting", None) if event["action"] == "started" else ("down", event["action"])
    elif event.get("rank") == 0 and (current is None or current.state != "down"):
        if kind == "start":
            target = ("joining", None)
        elif kind == "heal":
            target = ("healing", None)
        elif kind == "step" and event["committed"] and event["participating"]:
            target = ("training", None)
    if target is None or (current is not None and (current.state, current.reason) == target):
        return None
    return Transition(target[0], target[1], ts)


@dataclass
class GroupView:
    """What the control plane knows of one group right now."""

    group: int
    transition: Transition | None = None
    step: int | None = None
    loss: float | None = None
    participants: int | None = None
    quorum_id: int | None = None
    step_s: float | None = None
    last_event_ts: float | None = None
    last_heal: dict | None = None
    pid: int | None = None
    starts: int = 0
    history: list[Transition] = field(default_factory=list)

    @property
    def state(self) -> str:
        return self.transition.state if self.transition else "unknown"

    def observe(self, event: dict) -> Transition | None:
        """Fold one event in; returns the transition it caused, if any."""
        self.note(event)
        transition = next_state(self.transition, event)
        if transition is not None:
            self.apply(transition)
        return transition

    def note(self, event: dict) -> None:
        """Update the latest-known figures (step, loss, heal, pid) without touching the state."""
        self.last_event_ts = max(self.last_event_ts or 0.0, event["ts"])
        kind = event["type"]
        if kind == "step" and event.get("rank") == 0:
            self.participants = event["participants"]
            self.quorum_id = event["quorum_id"]
            if event["committed"]:
                self.step, self.loss, self.step_s = event["step"], event["loss"], event["step_s"]
        elif kind == "heal" and event.get("rank") == 0:
            self.last_heal = {k: event[k] for k in ("ts", "step", "source_group", "bytes", "fetch_s", "load_s")}
        elif kind == "process" and event["action"] == "started":
            self.pid = event.get("pid")
            self.starts += 1

    def apply(self, transition: Transition) -> None:
        self.transition = transition
        self.history.append(transition)
