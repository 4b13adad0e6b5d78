"""Where a group's state is decided: the state machine, and the board of every group's view.

    starting ──start──▶ joining ──heal──▶ healing ──committed step──▶ training
        ▲                   └──────────committed step──────────────────▲
        └── process started ── down (killed | crashed | stopped | finished) ◀── process exit

:func:`next_state` is the whole decision, a pure function of the current transition and one
event. Trainer events are read from files and can arrive after the agent's report that the
group died; an event older than the current state's entry time never moves the state.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, get_args

from protocol.events import (
    Event,
    HealEvent,
    ProcessEvent,
    SdcEvent,
    SyncEvent,
    StartEvent,
    StepEvent,
    StragglerEvent,
    speaks_for_group,
)
from service.controlplane.db import Store
from service.controlplane.errors import GroupStateConflict

State = Literal["starting", "joining", "healing", "training", "down"]
"""A transition's state."""
STATES: tuple[str, ...] = get_args(State)
Shown = Literal["unknown", State]
"""A group's state as shown: ``unknown`` before its first transition (never seen)."""


@dataclass(frozen=True)
class Transition:
    state: State
    reason: str | None
    ts: float


def next_state(current: Transition | None, event: Event) -> Transition | None:
    """The transition ``event`` causes from ``current``, or None."""
    if current is not None and event.ts < current.ts:
        return None
    # down ends only with a process event; "lost" is the control plane's inference from silence,
    # and the group's own word after it (a step, a heal) is the truth
    down = current is not None and current.state == "down" and current.reason != "lost"
    match event:
        case ProcessEvent(action="started"):
            target: tuple[State, str | None] = ("starting", None)
        case ProcessEvent(action=reason):
            target = ("down", reason)
        case _ if down or not speaks_for_group(event):
            return None
        case StartEvent():
            target = ("joining", None)
        case HealEvent():
            target = ("healing", None)
        case StepEvent(committed=True, participating=True):
            target = ("training", None)
        case _:
            return None
    if current is not None and (current.state, current.reason) == target:
        return None
    return Transition(target[0], target[1], event.ts)


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
    committed_at: float | None = None
    last_event_ts: float | None = None
    last_heal: HealEvent | None = None
    pid: int | None = None
    straggler: StragglerEvent | None = None
    """the detector's flag, while it stands"""
    last_sdc: SdcEvent | None = None
    """the gradient check's latest incident in this group"""
    last_sync: SyncEvent | None = None
    """its rank 0's latest sync across groups (``--sync localsgd|diloco``)"""
    exit_detail: str | None = None
    """why its processes last ended, as its agent said (a crash: the last error line of its log)"""
    trained: bool = False
    """a committed step of its rank 0 trained samples (a heal's step trains none: no loss)"""
    starts: int = 0
    history: list[Transition] = field(default_factory=list)

    @property
    def state(self) -> Shown:
        return self.transition.state if self.transition else "unknown"

    @property
    def up(self) -> bool:
        """Its processes run: every state but down (and unknown: never seen)."""
        return self.state not in ("down", "unknown")

    @property
    def down_reason(self) -> str | None:
        return self.transition.reason if self.state == "down" else None

    @property
    def down_detail(self) -> str | None:
        return self.exit_detail if self.state == "down" else None

    @property
    def diverged(self) -> bool:
        """The last committed step that trained samples had a loss that was not finite (its event
        carries it as null)."""
        return self.trained and self.loss is None

    def note(self, event: Event) -> None:
        """Update the latest-known figures (step, loss, heal, pid) without touching the state."""
        self.last_event_ts = max(self.last_event_ts or 0.0, event.ts)
        match event:
            case StepEvent() if speaks_for_group(event):
                self.participants, self.quorum_id = event.participants, event.quorum_id
                if event.committed:
                    self.step, self.step_s = event.step, event.step_s
                    self.committed_at = event.ts
                    if event.samples:
                        self.loss, self.trained = event.loss, True
            case HealEvent() if speaks_for_group(event):
                self.last_heal = event
            case ProcessEvent(action="started"):
                self.pid = event.pid
                self.starts += 1
            case ProcessEvent():
                self.exit_detail = event.detail
            case StragglerEvent():
                self.straggler = event if event.action == "flagged" else None
            case SdcEvent():
                self.last_sdc = event
            case SyncEvent() if speaks_for_group(event):
                self.last_sync = event

    def apply(self, transition: Transition) -> None:
        self.transition = transition
        self.history.append(transition)


class GroupBoard:
    """Every group's view, kept in step with the store: each transition is written as it happens."""

    def __init__(self, store: Store, groups: Iterable[int]):
        """``groups``: the groups known at start (the job's first N, and any registered before);
        a group seen later joins with :meth:`ensure`."""
        self.store = store
        self.views: dict[int, GroupView] = {g: self._load(g) for g in sorted(set(groups))}

    def ensure(self, group: int) -> GroupView:
        """The group's view; a group not seen before is added, with what the store holds of it.
        The board gets a new dict then (a request iterating the old one, in a worker thread,
        goes on undisturbed), kept in group order."""
        view = self.views.get(group)
        if view is None:
            view = self._load(group)
            self.views = dict(sorted({**self.views, group: view}.items()))
        return view

    def restore(self) -> None:
        """Rebuild the views from SQLite: after a restart, or a write that was rolled back."""
        for g in self.views:
            self.views[g] = self._load(g)

    def _load(self, g: int) -> GroupView:
        view = GroupView(g)
        for t in self.store.transitions(g):
            view.apply(Transition(t["state"], t["reason"], t["ts"]))
        for type_, rank, where in (("process", None, "json_extract(body, '$.action') != 'started'"),
                                   ("process", None, None), ("heal", 0, None), ("straggler", None, None),
                                   ("sdc", 0, None), ("sync", 0, None), ("step", 0, "json_extract(body, '$.committed') = 1 AND "
                                                                "json_extract(body, '$.samples') > 0"),
                                   ("step", 0, "json_extract(body, '$.committed') = 1")):
            latest = self.store.latest_event(g, type_, rank=rank, where_json=where)
            if latest is not None:
                view.note(latest)
        view.starts = self.store.count_events(g, "process", "json_extract(body, '$.action') = 'started'")
        return view

    def observe(self, event: Event) -> Transition | None:
        """Fold one event into its group's view; returns (and stores) the transition it caused."""
        view = self.ensure(event.group)
        view.note(event)
        transition = next_state(view.transition, event)
        if transition is not None:
            self._apply(event.group, transition)
        return transition

    def training(self) -> list[int]:
        """The groups training now (committing steps in the quorum)."""
        return [g for g, v in self.views.items() if v.state == "training"]

    def up(self) -> list[int]:
        """The groups whose processes run now: every state but down (and unknown: never seen)."""
        return [g for g, v in self.views.items() if v.up]

    def require_up(self, group: int) -> None:
        """A one-line 409 unless the group runs."""
        view = self.views[group]
        if view.state == "down":
            raise GroupStateConflict(f"group {group} is already down ({view.down_reason}); "
                                     "rejoin it before drilling or killing it")

    def median_step_s(self) -> float | None:
        """The groups' latest step times, median: what one step costs the job now."""
        steps = [v.step_s for v in self.views.values() if v.step_s]
        return statistics.median(steps) if steps else None

    def _apply(self, group: int, transition: Transition) -> None:
        self.views[group].apply(transition)
        self.store.add_transition(group, transition.state, transition.reason, transition.ts)
