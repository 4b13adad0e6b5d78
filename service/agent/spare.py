"""A warm spare: a copy of the group pre-started outside the quorum, promoted on rejoin.

Rejoining cold costs a torchrun start, ``import torch``, the corpus and the model build before
the heal can begin (seconds to minutes on big models). The spare pays all that in advance
and waits; promotion is one file, after which the spare creates its torchft Manager, joins
the quorum and heals from a peer. A new spare is started after each promotion.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.layout import GroupLayout
from protocol.agent import SpareState
from protocol.spare import promotion_file, readiness_file, spare_files
from service.agent.pidfile import reap_pidfile, record_pid
from service.agent.supervisor import GroupCommand

if TYPE_CHECKING:
    from service.agent.supervisor import GroupProcess

log = logging.getLogger("agent.spare")


class WarmSpare:
    def __init__(self, command: GroupCommand, run_dir: Path, respawn_delay_s: float):
        self.command = command
        self.group = command.group
        self.run_dir = run_dir
        self.respawn_delay_s = respawn_delay_s
        self.proc: GroupProcess | None = None
        self.generation = 0
        self._lock = threading.Lock()

    @property
    def pid_path(self) -> Path:
        return self.run_dir / GroupLayout(self.group).spare_pid

    def _promote_path(self) -> Path:
        return promotion_file(self.run_dir, self.group, self.generation)

    def _ready_paths(self) -> list[Path]:
        return [readiness_file(self._promote_path(), r) for r in range(self.command.ranks_per_group)]

    def launch(self) -> None:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            self.generation += 1
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # the spare promoted last may still be starting and must still find its file
            self.clean(keep_from=self.generation - 1)
            self.proc = self.command.spawn(f"starting a warm spare of group {self.group}",
                                           ("--spare-promote-file", str(self._promote_path())))
            record_pid(self.pid_path, self.proc.pid, self.group)
        log.info("group %d: warm spare %d starting (pid %d)", self.group, self.generation, self.proc.pid)

    def clean(self, keep_from: int) -> None:
        """Delete the promotion and readiness files of generations before ``keep_from``."""
        for generation, path in spare_files(self.run_dir, self.group):
            if generation is None or generation < keep_from:
                path.unlink(missing_ok=True)

    def state(self) -> SpareState | None:
        """None (no spare), "starting" or "ready"."""
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                return None
            return "ready" if all(p.exists() for p in self._ready_paths()) else "starting"

    def promote(self) -> "tuple[GroupProcess, str] | None":
        """Hand the spare over as the group's process, or None when there is none alive."""
        state = self.state()
        with self._lock:
            if state is None:
                return None
            self._promote_path().touch()
            proc, self.proc = self.proc, None
            self.pid_path.unlink(missing_ok=True)
        return proc, f"promoted warm spare ({state})"

    def replace_later(self, shutdown: threading.Event) -> None:
        """Start the next spare after a delay, leaving the CPU to the heal in the meantime."""

        def later() -> None:
            if not shutdown.wait(self.respawn_delay_s):
                self.launch()

        threading.Thread(target=later, name=f"spare-{self.group}", daemon=True).start()

    def reap(self) -> list[int]:
        """At agent start: kill a spare a dead agent left, and forget its files."""
        pids = reap_pidfile(self.pid_path, self.group)
        if self.run_dir.is_dir():
            self.clean(keep_from=self.generation + 1)
        return pids

    def stop(self) -> None:
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is not None:
            self.command.stop(proc)
