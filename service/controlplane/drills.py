"""Drills: scripted failures the control plane runs against the live job and reports on.

One drill runs at a time, and holds the groups while it runs: kill-heal and hang
(``kill_heal.py``), lighthouse (``lighthouse_drill.py``), chaos (``chaos.py``) or straggler
(``straggler_drill.py``; the straggler policy may still evict while it runs), corrupt
(``corrupt_drill.py``) or partition (``partition_drill.py``; the partition responder acts while
it runs: it is what the drill measures). Each keeps its
report in the drills table as it goes, so a client polling it watches the phases; a drill that
cannot go on ends ``failed`` with the phase and the reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from service.controlplane.agents import AgentClient
from service.controlplane.bus import EventBus
from service.controlplane.db import Store
from service.controlplane.drill_context import DrillContext
from service.controlplane.errors import DomainError, DrillConflict
from service.controlplane.group_control import GroupControl
from service.controlplane.chaos import ChaosRun
from service.controlplane.kill_heal import KillHealRun
from service.controlplane.lighthouse import LighthouseClient
from service.controlplane.lighthouse_drill import LighthouseRun
from service.controlplane.corrupt_drill import CorruptRun
from service.controlplane.models import (
    ChaosReport,
    CorruptReport,
    HangReport,
    KillHealReport,
    LighthouseReport,
    PartitionIn,
    PartitionReport,
    StragglerReport,
)
from service.controlplane.partition_drill import PartitionRun, lost_group, require_own_hosts
from service.controlplane.settings import ControlPlaneSettings
from service.controlplane.straggler_drill import StragglerRun
from service.controlplane.stragglers import StragglerTracker
from service.controlplane.timeline import FaultTimeline

log = logging.getLogger("controlplane.drills")


class DrillRunner:
    def __init__(self, settings: ControlPlaneSettings, store: Store, bus: EventBus, control: GroupControl,
                 agents: AgentClient, lighthouse: LighthouseClient, stragglers: StragglerTracker):
        self.settings = settings
        self.store = store
        self.bus = bus
        self.control = control
        self.agents = agents
        self.lighthouse = lighthouse
        self.stragglers = stragglers
        self.task: asyncio.Task | None = None
        self.current_id: int | None = None
        self._cancel_reason = ""

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def _check_idle(self) -> None:
        if self.running:
            raise DrillConflict(f"drill {self.current_id} is still running; wait for it or watch "
                                f"GET /api/v1/drills/{self.current_id}")

    def start_kill_heal(self, group: int, timeout_s: float | None) -> int:
        return self._start_recovery("kill-heal", KillHealReport, group, timeout_s)

    def start_hang(self, group: int, rank: int | None, mode: str, timeout_s: float | None) -> int:
        if rank is not None and rank >= self.settings.ranks_per_group:
            raise DrillConflict(f"group {group} has ranks 0..{self.settings.ranks_per_group - 1}, not {rank}")
        return self._start_recovery("hang", HangReport, group, timeout_s, rank=rank, mode=mode)

    def _start_recovery(self, kind: str, report_type: type[KillHealReport], group: int, timeout_s: float | None,
                        **fields) -> int:
        self._check_idle()
        self.control.require_up(group)
        survivors = FaultTimeline.survivors_of(group, self.control.board.views)
        if not survivors:
            raise DrillConflict(f"no other group is training: a fault of group {group} would stop the job, "
                                "not drill it")
        report = report_type(group=group, survivors=sorted(survivors), **fields)
        return self._start(kind, group, report,
                           lambda ctx: KillHealRun(ctx, report, timeout_s or self.settings.drill_timeout_s).run())

    def start_lighthouse(self, down_s: float, timeout_s: float | None) -> int:
        self._check_idle()
        views = self.control.board.views
        if any(v.state in ("down", "unknown") for v in views.values()):
            raise DrillConflict("the Lighthouse drill needs every group up (it measures that none goes down); " +
                                ", ".join(f"group {g} is {v.state}" for g, v in sorted(views.items())
                                          if v.state in ("down", "unknown")))
        report = LighthouseReport(down_s=down_s, groups=sorted(views))
        timeout = (timeout_s or self.settings.drill_timeout_s) + down_s  # per phase; the wait for it to come back
        return self._start("lighthouse", None, report, lambda ctx: LighthouseRun(ctx, report, timeout).run())

    def start_chaos(self, report: ChaosReport) -> int:
        self._check_idle()
        training = [g for g, v in self.control.board.views.items() if v.state == "training"]
        if len(training) < 2:
            raise DrillConflict(f"chaos needs at least 2 groups training, {len(training)} are")
        return self._start("chaos", None, report, lambda ctx: ChaosRun(ctx, report).run())

    def start_straggler(self, report: StragglerReport) -> int:
        self._check_idle()
        self.control.require_up(report.group)
        training = [g for g, v in self.control.board.views.items() if v.state == "training"]
        if report.group not in training or len(training) < 2:
            raise DrillConflict(f"the straggler drill needs group {report.group} and another group training; "
                                f"training now: {', '.join(map(str, training)) or 'none'}")
        return self._start("straggler", report.group, report, lambda ctx: StragglerRun(ctx, report, self.stragglers).run())

    def start_corrupt(self, report: CorruptReport, timeout_s: float | None) -> int:
        self._check_idle()
        self.control.require_up(report.group)
        if report.rank >= self.settings.ranks_per_group:
            raise DrillConflict(f"group {report.group} has ranks 0..{self.settings.ranks_per_group - 1}, not {report.rank}")
        training = [g for g, v in self.control.board.views.items() if v.state == "training"]
        if report.group not in training or len(training) < 2:
            raise DrillConflict(f"the corruption drill needs group {report.group} and another group training (the "
                                f"check compares groups); training now: {', '.join(map(str, training)) or 'none'}")
        timeout = timeout_s or self.settings.drill_timeout_s
        return self._start("corrupt", report.group, report, lambda ctx: CorruptRun(ctx, report, timeout).run())

    def start_partition(self, body: PartitionIn) -> int:
        """The groups named must each be on a host of their own (checked on their agents'
        addresses here; the agents refuse what else cannot be cut), and the group the others
        lose must leave at least one of them training."""
        self._check_idle()
        named = body.groups
        for g in named:
            self.control.require_up(g)
        views = self.control.board.views
        up = sorted(g for g, v in views.items() if v.state != "down")
        lost = lost_group(body.cut, body.isolate, up)
        survivors = FaultTimeline.survivors_of(lost, views)
        if not survivors:
            raise DrillConflict(f"no other group than {lost} is training: losing it would stop the job, not drill it")
        unregistered = [g for g in named if g not in self.agents.agents]
        if unregistered:
            raise DrillConflict(f"no agent is registered for group(s) {', '.join(map(str, unregistered))}: the "
                                "partition drill cuts the network from the groups' own agents")
        require_own_hosts({g: self.agents.agents[g] for g in named}, named)
        report = PartitionReport(group=lost, survivors=sorted(survivors), cut=body.cut, isolate=body.isolate,
                                 duration_s=body.duration_s)
        timeout = body.timeout_s or self.settings.drill_timeout_s
        return self._start("partition", lost, report, lambda ctx: PartitionRun(ctx, report, timeout).run())

    def _start(self, kind: str, group: int | None,
               report: KillHealReport | LighthouseReport | ChaosReport | StragglerReport | CorruptReport,
               run: Callable[[DrillContext], Awaitable[None]]) -> int:
        drill_id = self.store.create_drill(kind, group, report.model_dump())
        self.current_id = drill_id
        self.control.hold(drill_id, kind)

        def save(status: str = "running", error: str | None = None) -> None:
            self.store.update_drill(drill_id, status, report.model_dump(), error)

        async def main() -> None:
            try:
                await run(DrillContext(drill_id, self.bus, self.control, self.agents, self.lighthouse, self.settings,
                                       save))
                report.phase = "done"
                save("done")
            except (TimeoutError, DomainError) as err:
                log.warning("drill %d failed in phase %s: %s", drill_id, report.phase, err)
                save("failed", f"{report.phase}: {err}")
            except Exception as err:  # a bug must still end the drill as failed, not leave it running
                log.exception("drill %d crashed", drill_id)
                save("failed", f"{report.phase}: {type(err).__name__}: {err}")
            except asyncio.CancelledError:
                save("cancelled", f"{report.phase}: {self._cancel_reason}")
                raise
            finally:
                self.control.release(drill_id)

        self.task = asyncio.create_task(main())
        return drill_id

    async def cancel(self, reason: str = "the control plane stopped") -> None:
        """End the running drill where it is (its report keeps what it measured, status
        ``cancelled``) and release the groups. A fault it injected runs out by itself: a slow
        group's delay at its ``--duration``, a persistent corruption at its window."""
        if self.running:
            self._cancel_reason = reason
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

    async def cancel_drill(self, drill_id: int) -> None:
        """``DELETE /api/v1/drills/{id}``: only the drill that runs can be cancelled."""
        if not self.running or self.current_id != drill_id:
            raise DrillConflict(f"drill {drill_id} is not running" + (
                f"; drill {self.current_id} is" if self.running else ""))
        await self.cancel("cancelled by request")
