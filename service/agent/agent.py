"""One agent's parts, wired together: the group's supervisor, its warm spare, its forwarder."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.agent import AgentStatus
from service.agent.config import AgentSettings
from service.agent.forwarder import EventForwarder
from service.agent.spare import WarmSpare
from service.agent.supervisor import GroupCommand, GroupSupervisor


@dataclass
class Agent:
    settings: AgentSettings
    forwarder: EventForwarder
    supervisor: GroupSupervisor
    spare: WarmSpare | None

    @classmethod
    def build(cls, settings: AgentSettings) -> "Agent":
        trainer_args = [
            "--group", str(settings.group), "--groups", str(settings.groups),
            "--ranks-per-group", str(settings.ranks_per_group), "--lighthouse", settings.lighthouse, "--events-dir", str(settings.events_dir),
            *(["--advertise-host", settings.advertise_host] if settings.advertise_host else []),
            *settings.trainer_args,
        ]
        forwarder = EventForwarder(settings.group, settings.events_dir, settings.control_plane, settings.token,
                                   settings.buffer_capacity, settings.forward_interval_s, settings.forward_batch,
                                   settings.forward_timeout_s)
        command = GroupCommand(settings.group, settings.ranks_per_group, trainer_args, settings.advertise_host,
                               settings.log_path, settings.stop_timeout_s)
        spare = WarmSpare(command, settings.run_dir, settings.spare_respawn_delay_s) if settings.spare else None
        supervisor = GroupSupervisor(command, settings.pid_path, forwarder.emit_process,
                                     settings.auto_rejoin_delay_s, spare)
        return cls(settings, forwarder, supervisor, spare)

    def open(self) -> None:
        """At start: end what a dead predecessor left, start forwarding, start the group."""
        self.settings.events_dir.mkdir(parents=True, exist_ok=True)
        self.supervisor.reap_orphans()
        self.forwarder.start()
        if self.settings.autostart:
            self.supervisor.start()

    def close(self) -> None:
        """Stop the group gracefully (and its spare), then ship its last events."""
        self.supervisor.shutdown()
        self.forwarder.stop()

    def status(self) -> AgentStatus:
        supervisor, forwarder = self.supervisor, self.forwarder
        running = supervisor.running
        return AgentStatus(
            group=self.settings.group, state="running" if running else "down",
            pid=supervisor.proc.pid if running else None, pids=supervisor.pids(),
            starts=supervisor.starts, restarts=supervisor.restarts, last_step=forwarder.last_step,
            last_exit=supervisor.last_exit, events_buffered=len(forwarder.buffer),
            events_dropped=forwarder.dropped, events_forwarded=forwarder.forwarded,
            control_plane_reachable=forwarder.reachable, spare=self.spare.state() if self.spare else None,
        )
