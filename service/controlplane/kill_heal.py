"""The kill-heal drill (the seed's chapter 10), as one observer of the job's event stream.

SIGKILL one group; measure how fast the survivors notice and commit again; rejoin it (or see
its agent restart it by itself); measure the heal from a live peer; check that every group
holds bitwise identical state afterwards (per-rank fingerprints at one common step).

Every event goes through ``observe`` exactly once, whatever phase the drill is waiting in:
events from different agents arrive out of order, and a fail-over to a warm spare can heal
the group before the survivors' first commit has even been received.
"""

from __future__ import annotations

import time
from typing import Callable

from service.controlplane import group_control
from service.controlplane.agents import AgentClient
from service.controlplane.hub import Hub
from service.controlplane.models import KillHealReport


class KillHealRun:
    def __init__(self, hub: Hub, agents: AgentClient, report: KillHealReport, save: Callable[[], None],
                 nproc_per_group: int, timeout_s: float):
        self.hub = hub
        self.agents = agents
        self.r = report
        self.save = save
        self.nproc = nproc_per_group
        self.timeout_s = timeout_s
        self.survivors = set(report.survivors)
        self.quorum_before = {s: hub.views[s].quorum_id for s in self.survivors}
        self.lost = {s: 0 for s in self.survivors}
        self.fingerprints: dict[int, dict[tuple[int, int], str]] = {}

    def observe(self, e: dict) -> None:
        r = self.r
        if e["ts"] < r.killed_at:
            return
        if e["group"] == r.group:
            self._observe_killed_group(e)
        elif e["group"] in self.survivors and e.get("rank") == 0 and r.survivors_first_commit_at is None:
            self._observe_survivor(e)
        if e["type"] == "fingerprint" and (e["group"] in self.survivors or e["group"] == r.group):
            self.fingerprints.setdefault(e["step"], {})[(e["group"], e["rank"])] = e["digest"]

    def _observe_killed_group(self, e: dict) -> None:
        r = self.r
        if e["type"] == "process" and e["action"] == "started" and r.rejoined_at is None:
            r.rejoined_at, r.rejoined_by = e["ts"], "agent"
        elif e.get("rank") != 0 or r.healed_commit_at is not None:
            return
        elif e["type"] == "heal":
            r.heal_started_at, r.heal_bytes, r.heal_fetch_s = e["ts"], e["bytes"], e["fetch_s"]
        elif e["type"] == "step" and e["committed"] and r.heal_started_at is not None:
            r.healed_commit_at, r.healed_step = e["ts"], e["step"]

    def _observe_survivor(self, e: dict) -> None:
        r = self.r
        if e["type"] == "torchft" and e["logger"] == "torchft_quorums" and r.quorum_shrunk_at is None:
            r.quorum_shrunk_at = e["ts"]
        elif e["type"] == "commit_failed":
            self.lost[e["group"]] += 1
        elif e["type"] == "step" and e["committed"] and (
                e["participants"] < r.participants_before or e["quorum_id"] != self.quorum_before[e["group"]]):
            r.survivors_first_commit_at = e["ts"]  # a quorum without the killed group: shrunk, or with its spare

    def common_fingerprint_step(self) -> int | None:
        """The first step, from the healed one on, at which every rank of every group reported."""
        if self.r.healed_step is None:
            return None
        complete = [step for step, seen in self.fingerprints.items()
                    if step >= self.r.healed_step and len(seen) == (len(self.survivors) + 1) * self.nproc]
        return min(complete, default=None)

    async def until(self, queue, done: Callable[[], bool], what: str) -> None:
        if not done():
            await self.hub.wait_for(queue, lambda e: (self.observe(e), done())[1], self.timeout_s, what)

    async def run(self) -> None:
        r, g = self.r, self.r.group
        queue = self.hub.subscribe()
        try:
            r.phase = "kill"
            r.killed_at = time.time()
            await group_control.kill(self.agents, self.hub, g, r.killed_at)
            self.save()

            r.phase = "survivors"
            await self.until(queue, lambda: r.survivors_first_commit_at is not None,
                             "a survivor to commit without the killed group")
            r.quorum_shrunk_at = r.quorum_shrunk_at or r.survivors_first_commit_at
            r.survivors_steps_lost = max(self.lost.values())
            r.detect_s = r.quorum_shrunk_at - r.killed_at
            r.survivors_resume_s = r.survivors_first_commit_at - r.killed_at
            self.save()

            r.phase = "rejoin"
            await self._rejoin(queue)
            self.save()

            r.phase = "heal"
            await self.until(queue, lambda: r.healed_commit_at is not None, f"group {g} to heal and commit")
            r.rejoin_to_healed_commit_s = r.healed_commit_at - r.rejoined_at
            r.kill_to_full_s = r.healed_commit_at - r.killed_at
            self.save()

            r.phase = "fingerprints"
            await self.until(queue, lambda: self.common_fingerprint_step() is not None,
                             "fingerprints from every rank of every group")
            step = self.common_fingerprint_step()
            digests = self.fingerprints[step]
            members = sorted(self.survivors | {g})
            r.fingerprint_step = step
            r.fingerprints = {str(m): {str(k): digests[(m, k)] for k in range(self.nproc)} for m in members}
            r.fingerprints_equal = all(len({digests[(m, k)] for m in members}) == 1 for k in range(self.nproc))
        finally:
            self.hub.unsubscribe(queue)

    async def _rejoin(self, queue) -> None:
        """Rejoin the group, unless its agent restarted it by itself (``--auto-rejoin-delay``)."""
        r = self.r
        if r.rejoined_at is not None:
            return
        sent = await group_control.rejoin_unless_restarted(self.agents, self.hub, r.group)
        if sent is None:
            await self.until(queue, lambda: r.rejoined_at is not None, f"group {r.group}'s agent to restart it")
        else:
            r.rejoined_at, r.rejoined_by = sent, "drill"
