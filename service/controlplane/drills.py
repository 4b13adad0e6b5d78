"""Drills: scripted failures the control plane runs against the live job and reports on.

kill-heal (the seed's chapter 10): SIGKILL one group, measure how fast the survivors notice
and commit again, rejoin it, measure the heal from a live peer, and check that every group
holds bitwise identical state afterwards (per-rank fingerprints at one common step).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import HTTPException

from service.controlplane.agents import AgentClient
from service.controlplane.chaos import ChaosReport, ChaosRun
from service.controlplane.db import Store
from service.controlplane.hub import Hub
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
                await ChaosRun(self.hub, self.agents.command, report, save).run()
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
        queue = self.hub.subscribe()
        try:
            await self._run_phases(drill_id, r, queue, timeout_s)
            r.phase = "done"
            self._save(drill_id, r, "done")
        except (TimeoutError, HTTPException) as err:
            message = err.detail if isinstance(err, HTTPException) else str(err)
            log.warning("drill %d failed in phase %s: %s", drill_id, r.phase, message)
            self._save(drill_id, r, "failed", f"{r.phase}: {message}")
        except Exception as err:  # a bug must still end the drill as failed, not leave it running
            log.exception("drill %d crashed", drill_id)
            self._save(drill_id, r, "failed", f"{r.phase}: {type(err).__name__}: {err}")
        finally:
            self.hub.unsubscribe(queue)

    async def _run_phases(self, drill_id: int, r: KillHealReport, queue: asyncio.Queue, timeout_s: float) -> None:
        g, survivors = r.group, set(r.survivors)
        quorum_before = {s: self.hub.views[s].quorum_id for s in survivors}

        r.phase = "kill"
        r.killed_at = time.time()
        await self.agents.command(g, "kill")
        self.hub.force(g, "down", "killed", since=r.killed_at)
        self._save(drill_id, r)

        r.phase = "survivors"
        lost: dict[int, int] = {s: 0 for s in survivors}

        def survivors_back(e: dict) -> bool:
            if e["ts"] < r.killed_at:
                return False
            if restarted_by_agent(e):
                r.rejoined_at, r.rejoined_by = r.rejoined_at or e["ts"], "agent"
                return False
            if e["group"] not in survivors or e.get("rank") != 0:
                return False
            if e["type"] == "torchft" and e["logger"] == "torchft_quorums" and r.quorum_shrunk_at is None:
                r.quorum_shrunk_at = e["ts"]
            elif e["type"] == "commit_failed":
                lost[e["group"]] += 1
            elif e["type"] == "step" and e["committed"] and (
                    e["participants"] < r.participants_before or e["quorum_id"] != quorum_before[e["group"]]):
                return True  # a quorum without the killed group: shrunk, or with its spare promoted in
            return False

        def restarted_by_agent(e: dict) -> bool:
            return e["group"] == g and e["type"] == "process" and e["action"] == "started" and e["ts"] >= r.killed_at

        first = await self.hub.wait_for(queue, survivors_back, timeout_s, "a survivor to commit without the killed group")
        r.survivors_first_commit_at = first["ts"]
        r.quorum_shrunk_at = r.quorum_shrunk_at or first["ts"]
        r.survivors_steps_lost = max(lost.values())
        r.detect_s = r.quorum_shrunk_at - r.killed_at
        r.survivors_resume_s = r.survivors_first_commit_at - r.killed_at
        self._save(drill_id, r)

        r.phase = "rejoin"
        if r.rejoined_at is None:
            rejoined_at = time.time()
            try:
                await self.agents.command(g, "rejoin")
                r.rejoined_at, r.rejoined_by = rejoined_at, "drill"
                self.hub.force(g, "starting", None, since=rejoined_at)
            except HTTPException as err:
                if err.status_code != 409:
                    raise
                # the agent restarted the group on its own (--auto-rejoin-delay) while we asked
                started = await self.hub.wait_for(queue, restarted_by_agent, timeout_s, f"group {g}'s agent to restart it")
                r.rejoined_at, r.rejoined_by = started["ts"], "agent"
        self._save(drill_id, r)

        r.phase = "heal"

        def healed_commit(e: dict) -> bool:
            if e["group"] != g or e.get("rank") != 0 or e["ts"] < r.rejoined_at:
                return False
            if e["type"] == "heal":
                r.heal_started_at, r.heal_bytes, r.heal_fetch_s = e["ts"], e["bytes"], e["fetch_s"]
                return False
            return e["type"] == "step" and e["committed"] and r.heal_started_at is not None

        healed = await self.hub.wait_for(queue, healed_commit, timeout_s, f"group {g} to heal and commit")
        r.healed_commit_at, r.healed_step = healed["ts"], healed["step"]
        r.rejoin_to_healed_commit_s = r.healed_commit_at - r.rejoined_at
        r.kill_to_full_s = r.healed_commit_at - r.killed_at
        self._save(drill_id, r)

        r.phase = "fingerprints"
        members = sorted(survivors | {g})
        seen: dict[int, dict[tuple[int, int], str]] = {}

        def full_set(e: dict) -> bool:
            if e["type"] != "fingerprint" or e["group"] not in members or e["step"] < r.healed_step:
                return False
            at = seen.setdefault(e["step"], {})
            at[(e["group"], e["rank"])] = e["digest"]
            return len(at) == len(members) * self.nproc

        done = await self.hub.wait_for(queue, full_set, timeout_s, "fingerprints from every rank of every group")
        digests = seen[done["step"]]
        r.fingerprint_step = done["step"]
        r.fingerprints = {str(m): {str(k): digests[(m, k)] for k in range(self.nproc)} for m in members}
        r.fingerprints_equal = all(len({digests[(m, k)] for m in members}) == 1 for k in range(self.nproc))

    async def cancel(self) -> None:
        if self.running:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
