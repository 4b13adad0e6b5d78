"""Drills: scripted failures the control plane runs against the live job and reports on.

One drill runs at a time: kill-heal (``kill_heal.py``) or chaos (``chaos.py``). Each keeps
its report in the drills table as it goes, so a client polling it watches the phases.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import HTTPException

from service.controlplane.agents import AgentClient
from service.controlplane.chaos import ChaosReport, ChaosRun
from service.controlplane.db import Store
from service.controlplane.hub import Hub
from service.controlplane.kill_heal import KillHealRun
from service.controlplane.models import KillHealReport

log = logging.getLogger("controlplane.drills")


class DrillConflict(Exception):
    pass


class DrillRunner:
    def __init__(self, hub: Hub, store: Store, agents: AgentClient, nproc_per_group: int, timeout_s: float):
        self.hub = hub
        self.store = store
        self.agents = agents
        self.nproc = nproc_per_group
        self.timeout_s = timeout_s
        self.task: asyncio.Task | None = None
        self.current_id: int | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def _check_idle(self) -> None:
        if self.running:
            raise DrillConflict(f"drill {self.current_id} is still running; wait for it or watch GET /api/v1/drills/{self.current_id}")

    def start_chaos(self, report: ChaosReport) -> int:
        self._check_idle()
        training = [g for g, v in self.hub.views.items() if v.state == "training"]
        if len(training) < 2:
            raise DrillConflict(f"chaos needs at least 2 groups training, {len(training)} are")
        drill_id = self.store.create_drill("chaos", None, report.model_dump())
        self.current_id = drill_id

        def save(status: str = "running", error: str | None = None) -> None:
            self.store.update_drill(drill_id, status, report.model_dump(), error)

        async def main() -> None:
            try:
                await ChaosRun(self.hub, self.agents, report, save).run()
                report.phase = "done"
                save("done")
            except HTTPException as err:
                save("failed", f"{report.phase}: {err.detail}")
            except Exception as err:  # a bug must still end the drill as failed
                log.exception("chaos drill %d crashed", drill_id)
                save("failed", f"{report.phase}: {type(err).__name__}: {err}")

        self.task = asyncio.create_task(main())
        return drill_id

    def start_kill_heal(self, group: int, timeout_s: float | None) -> int:
        self._check_idle()
        views = self.hub.views
        if views[group].state == "down":
            raise DrillConflict(f"group {group} is down; rejoin it before drilling it")
        survivors = [g for g, v in views.items() if g != group and v.state == "training"]
        if not survivors:
            raise DrillConflict(f"no other group is training: killing group {group} would stop the job, not drill it")
        report = KillHealReport(group=group, survivors=survivors,
                                participants_before=views[group].participants or len(survivors) + 1)
        drill_id = self.store.create_drill("kill-heal", group, report.model_dump())
        self.current_id = drill_id
        self.task = asyncio.create_task(self._kill_heal(drill_id, report, timeout_s or self.timeout_s))
        return drill_id

    def _save(self, drill_id: int, report: KillHealReport, status: str = "running", error: str | None = None) -> None:
        self.store.update_drill(drill_id, status, report.model_dump(), error)

    async def _kill_heal(self, drill_id: int, r: KillHealReport, timeout_s: float) -> None:
        try:
            await KillHealRun(self.hub, self.agents, r, lambda: self._save(drill_id, r), self.nproc,
                              timeout_s).run()
            r.phase = "done"
            self._save(drill_id, r, "done")
        except (TimeoutError, HTTPException) as err:
            message = err.detail if isinstance(err, HTTPException) else str(err)
            log.warning("drill %d failed in phase %s: %s", drill_id, r.phase, message)
            self._save(drill_id, r, "failed", f"{r.phase}: {message}")
        except Exception as err:  # a bug must still end the drill as failed, not leave it running
            log.exception("drill %d crashed", drill_id)
            self._save(drill_id, r, "failed", f"{r.phase}: {type(err).__name__}: {err}")

    async def cancel(self) -> None:
        if self.running:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
