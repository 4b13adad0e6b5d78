"""The drill runner: one drill at a time, holding the groups while it runs.

A drill keeps its report in the drills table as it goes, so a client polling it watches the
phases; a drill that cannot go on ends ``failed`` with the phase and the reason. The straggler
policy may still evict while a straggler drill runs, and the partition responder acts while a
partition drill runs: it is what the drill measures.
"""

from __future__ import annotations

import asyncio
import logging

from protocol import api
from service.controlplane.db import Store
from service.controlplane.drills.base import Drill, DrillBody
from service.controlplane.drills.context import DrillContext, DrillServices
from service.controlplane.errors import DomainError, DrillConflict

log = logging.getLogger("controlplane.drills")


class DrillRunner:
    def __init__(self, services: DrillServices, store: Store):
        self.services = services
        self.store = store
        self.task: asyncio.Task | None = None
        self.current_id: int | None = None
        self._cancel_reason = ""

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, request: DrillBody) -> int:
        """Check ``request``'s preconditions, then run it in the background; its id."""
        if self.running:
            raise DrillConflict(f"drill {self.current_id} is still running; wait for it or watch "
                                f"GET {api.url(api.DRILL, drill_id=self.current_id)}")
        drill_type = Drill.registry[request.kind]
        prepared = drill_type.prepare(request, self.services)
        report = prepared.report
        drill_id = self.store.create_drill(request.kind, prepared.group, report.model_dump())
        self.current_id = drill_id
        control = self.services.control
        control.hold(drill_id, request.kind)

        def save(status: str = "running", error: str | None = None) -> None:
            self.store.update_drill(drill_id, status, report.model_dump(), error)

        async def main() -> None:
            try:
                context = DrillContext(**vars(self.services), drill_id=drill_id, save=save)
                await drill_type(context, request, report).run()
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
                control.release(drill_id)

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
        """``DELETE /drills/{id}``: only the drill that runs can be cancelled."""
        if not self.running or self.current_id != drill_id:
            raise DrillConflict(f"drill {drill_id} is not running" + (
                f"; drill {self.current_id} is" if self.running else ""))
        await self.cancel("cancelled by request")
