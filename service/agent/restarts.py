"""When a group that went down by itself starts again: at once, after a backoff, or held.

Llama 3 saw 466 interruptions in 54 days and needed a person for 3 of them. So a group whose
processes crashed, hung (the watchdog ended them) or were killed from outside comes back
without anyone typing ``ftctl rejoin``: its warm spare if one is ready, else a fresh start
(``GroupSupervisor.start``). What a person decided is kept: a ``kill``, ``evict`` or drain
from the control plane, a quarantine (its warm spare replaces it, never its suspect ranks), a
finished group stay down. A drill's kill stands for a node loss: it comes back at
once, and is not held against the group.

A group that fails again and again must not restart in a tight loop that burns its node and
floods the others with heals: :func:`restart_plan` backs off exponentially (the first retry at
once, then 1, 2, 4 … seconds up to a cap) and, after ``limit`` unplanned exits within
``window_s``, holds the group down (``crash-loop``) for ``cooldown_s`` before it tries again.
The decision is a pure function of the times of the group's unplanned exits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel, Field


@dataclass(frozen=True)
class RestartPolicy:
    backoff_cap_s: float = 60.0
    """the longest wait between two restarts outside a crash loop"""
    limit: int = 5
    """this many unplanned exits within ``window_s`` is a crash loop"""
    window_s: float = 600.0
    cooldown_s: float = 300.0
    """how long a crash-looping group is held down before it is tried again"""


@dataclass(frozen=True)
class RestartPlan:
    delay_s: float
    """how long to wait before the restart"""
    failures: int
    """unplanned exits within the window, the one just seen included"""
    crash_loop: bool
    """held down for the cool-down: ``failures`` reached the policy's limit"""


def restart_plan(policy: RestartPolicy, failures: Sequence[float], now: float) -> RestartPlan:
    """The restart after an unplanned exit at ``now``; ``failures``: the times of this group's
    unplanned exits so far, that one included. Exits older than the window are forgotten, so a
    group that ran well for a while starts again at once; a held group tried after its
    cool-down and failing again is held again until its failures age out."""
    recent = sum(1 for t in failures if now - policy.window_s < t <= now)
    if recent >= policy.limit:
        return RestartPlan(policy.cooldown_s, recent, crash_loop=True)
    delay = 0.0 if recent <= 1 else min(policy.backoff_cap_s, 2.0 ** (recent - 2))
    return RestartPlan(delay, recent, crash_loop=False)


class RestartSettings(BaseModel):
    """The restart policy's flags, the same on ``ftctl up`` and on each agent it starts."""

    auto_rejoin: bool = Field(True, description="a group that crashed, hung or was killed from outside comes back "
                              "by itself (its warm spare if ready, else a fresh start), backing off when it fails "
                              "again; a kill, evict or drain someone asked for, or a quarantine, stays down "
                              "(--no-auto-rejoin: every group stays down until rejoined)")
    rejoin_backoff_cap_s: float = Field(RestartPolicy.backoff_cap_s, gt=0, description="the longest wait between two "
                                        "automatic restarts of a group (the first is at once, then 1, 2, 4 … s)")
    crash_loop_limit: int = Field(RestartPolicy.limit, ge=1, description="this many unplanned exits of a group within "
                                  "--crash-loop-window-s hold it down as crash-looping")
    crash_loop_window_s: float = Field(RestartPolicy.window_s, gt=0, description="see --crash-loop-limit")
    crash_loop_cooldown_s: float = Field(RestartPolicy.cooldown_s, gt=0, description="a crash-looping group is held "
                                         "down this long, then tried again")

    def restart_policy(self) -> RestartPolicy | None:
        """The policy, or None: groups stay down until rejoined."""
        if not self.auto_rejoin:
            return None
        return RestartPolicy(self.rejoin_backoff_cap_s, self.crash_loop_limit, self.crash_loop_window_s,
                             self.crash_loop_cooldown_s)

    def restart_flags(self) -> list[str]:
        """These settings as the agent's command-line flags."""
        flags = [] if self.auto_rejoin else ["--no-auto-rejoin"]
        for name in RestartSettings.model_fields:
            if name != "auto_rejoin":
                flags += [f"--{name.replace('_', '-')}", str(getattr(self, name))]
        return flags
