"""One agent's parts, wired together: the group's supervisor, its warm spare, its forwarder."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from protocol.layout import GroupLayout
from protocol.events import ProcessEvent
from protocol.agent import AgentStatus
from protocol.beacon import read_beacon
from protocol.files import write_model
from protocol.injection import InjectRequest, InjectResult, Injection, read_injection
from protocol.lighthouse import lighthouse_unreachable
from protocol.quarantine import take_quarantine
from protocol.registration import AgentRegistration
from service.agent.config import AgentSettings
from service.agent.forwarder import EventForwarder
from service.agent.netcut import RouteCut
from service.agent.spare import WarmSpare
from service.agent.supervisor import GroupCommand, GroupSupervisor, StateConflict
from service.agent.watchdog import Watchdog
from service.agent.zygote import Zygote


def _lighthouse_away(address: str) -> str | None:
    try:
        return lighthouse_unreachable(address, timeout_s=1.0)
    except ValueError:
        return None  # a malformed address: the trainer says so in one line when it starts


@dataclass
class Agent:
    settings: AgentSettings
    forwarder: EventForwarder
    supervisor: GroupSupervisor
    spare: WarmSpare | None
    watchdog: Watchdog | None
    zygote: Zygote | None
    netcut: RouteCut

    @classmethod
    def build(cls, settings: AgentSettings) -> "Agent":
        trainer_args = [
            "--group", str(settings.group), "--groups", str(settings.groups),
            "--ranks-per-group", str(settings.ranks_per_group), "--lighthouse", settings.lighthouse, "--events-dir", str(settings.events_dir),
            *(["--advertise-host", settings.advertise_host] if settings.advertise_host else []),
            *settings.trainer_args,
        ]
        zygote = Zygote(settings.group, trainer_args, settings.log_path) if settings.zygote else None
        command = GroupCommand(settings.group, settings.ranks_per_group, trainer_args, settings.advertise_host,
                               settings.log_path, settings.stop_timeout_s, zygote)
        spare = WarmSpare(command, settings.run_dir, settings.spare_respawn_delay_s) if settings.spare else None
        watchdog: Watchdog | None = None

        def on_process_event(action: str, **fields) -> ProcessEvent:
            if action == "started" and watchdog is not None:
                watchdog.started()
            return forwarder.emit_process(action, **fields)

        supervisor = GroupSupervisor(command, settings.pid_path, on_process_event, settings.restart_policy(), spare,
                                     lighthouse_away=lambda: _lighthouse_away(settings.lighthouse),
                                     take_quarantine=lambda: take_quarantine(settings.events_dir, settings.group))
        if settings.watchdog:
            watchdog = Watchdog(settings.watchdog_settings(), settings.events_dir, settings.group,
                                settings.ranks_per_group, supervisor.owns, supervisor.end_hung)
        forwarder = EventForwarder(settings.group, settings.events_dir, settings.control_plane, settings.token,
                                   settings.buffer_capacity, settings.forward_interval_s, settings.forward_batch,
                                   settings.forward_timeout_s,
                                   on_step=(lambda e: watchdog.stepped(e.step_s)) if watchdog else lambda e: None,
                                   registration=AgentRegistration(url=settings.api_url(),
                                                                  ranks_per_group=settings.ranks_per_group))
        netcut = RouteCut(settings.group, settings.run_dir / GroupLayout(settings.group).cut, settings.lighthouse,
                          settings.control_plane)
        return cls(settings, forwarder, supervisor, spare, watchdog, zygote, netcut)

    def open(self) -> None:
        """At start: end what a dead predecessor left, start forwarding, start the group."""
        self.settings.events_dir.mkdir(parents=True, exist_ok=True)
        self.netcut.undo_predecessors()
        self.supervisor.reap_orphans()
        take_quarantine(self.settings.events_dir, self.settings.group)  # a predecessor's, about ranks now gone
        self.forwarder.start()
        if self.zygote:
            self.zygote.start()
        if self.watchdog:
            self.watchdog.start()
        if self.settings.autostart:
            self.supervisor.start()

    def close(self) -> None:
        """Mend a cut, stop the group gracefully (and its spare), then ship its last events."""
        self.netcut.mend()
        if self.watchdog:
            self.watchdog.stop()
        self.supervisor.shutdown()
        if self.zygote:
            self.zygote.stop()
        self.forwarder.stop()

    def rank_pids(self) -> dict[int, int]:
        """rank → pid of the group's ranks that are up (their beacon names a process of the group)."""
        tree = set(self.supervisor.pids())
        beacons = {r: read_beacon(self.settings.events_dir / GroupLayout(self.settings.group).beacon(r))
                   for r in range(self.settings.ranks_per_group)}
        return {r: b.pid for r, b in beacons.items() if b is not None and b.pid in tree}

    def inject(self, request: InjectRequest) -> InjectResult:
        """A drill's fault, now: SIGSTOP the ranks, or have them sleep inside their next step
        (stuck) or before every forward, or every n-th, for a while (slow), corrupt a gradient of
        one of them (corrupt), or measure their updates for a while (watch)."""
        ranks = self.rank_pids()
        rank = 0 if request.kind == "corrupt" and request.rank is None else request.rank  # corruption is one chip's
        if rank is not None:
            ranks = {r: p for r, p in ranks.items() if r == rank}
        if not ranks:
            raise StateConflict(f"group {self.settings.group} has no rank up"
                                + (f" with rank {rank}" if rank is not None else "")
                                + "; start it (or wait for it) first")
        at = time.time()
        if request.kind == "stop":
            for pid in ranks.values():
                os.kill(pid, signal.SIGSTOP)
        else:
            path = self.settings.events_dir / GroupLayout(self.settings.group).injection
            previous = read_injection(path)
            injection = Injection(id=(previous.id if previous else 0) + 1, kind=request.kind, rank=rank,
                                  pids=sorted(ranks.values()), seconds=request.seconds, delay_s=request.delay_ms / 1000,
                                  every=request.every, offset=request.offset, until=at + request.seconds,
                                  scale=request.scale, persistent=request.persistent)
            write_model(path, injection)
        return InjectResult(group=self.settings.group, kind=request.kind, ranks=sorted(ranks),
                            pids=sorted(ranks.values()), at=at)

    def status(self) -> AgentStatus:
        supervisor, forwarder = self.supervisor, self.forwarder
        running = supervisor.running
        return AgentStatus(
            group=self.settings.group, state="running" if running else "down",
            pid=supervisor.proc.pid if running else None, pids=supervisor.pids(),
            starts=supervisor.starts, restarts=supervisor.restarts, last_step=forwarder.last_step,
            last_exit=supervisor.last_exit, restart_at=supervisor.restart_at, events_buffered=len(forwarder.buffer),
            events_dropped=forwarder.dropped, events_refused=forwarder.refused, events_invalid=forwarder.invalid,
            events_forwarded=forwarder.forwarded,
            control_plane_reachable=forwarder.reachable, spare=self.spare.state() if self.spare else None,
            cut=self.netcut.state,
        )
