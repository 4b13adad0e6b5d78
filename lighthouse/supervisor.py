"""Keeps torchft's Lighthouse running: a child process, restarted whenever it dies.

:meth:`LighthouseSupervisor.kill` is the Lighthouse drill's fault: a SIGKILL, as when its
node dies, with the restart held back for as long as the drill wants the Lighthouse away."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from lighthouse.config import LighthouseSettings
from protocol.tokens import without_tokens

log = logging.getLogger("lighthouse")


class LighthouseSupervisor:
    def __init__(self, settings: LighthouseSettings):
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0
        self._killed: subprocess.Popen | None = None
        self._hold_until = 0.0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="lighthouse-watch", daemon=True)

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        env = {**without_tokens(dict(os.environ)), "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        with self._lock:
            self.proc = subprocess.Popen(self.settings.command(), env=env)
            self.started_at = time.time()
        log.info("lighthouse pid %d on %s", self.proc.pid, self.settings.bind)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _watch(self) -> None:
        while not self._stopping.is_set():
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            delay = max(self.settings.restart_delay_s, self._hold_until - time.time())
            log.warning("lighthouse exited with %s; restarting in %.1fs", code, delay)
            if self._stopping.wait(delay):
                return
            self.restarts += 1
            self._spawn()

    def kill(self, down_s: float) -> tuple[int, float, float]:
        """SIGKILL the running Lighthouse and restart it no sooner than ``down_s`` from now.

        Returns its pid, the kill time and the restart time. Raises LookupError when none runs
        (it is already down, between a death and its restart)."""
        with self._lock:
            proc = self.proc
            # a process just SIGKILLed may not have exited yet: it is down all the same
            if proc is None or proc.poll() is not None or proc is self._killed:
                raise LookupError("the Lighthouse is not running: it is already down and will be restarted")
            now = time.time()
            self._hold_until = now + down_s
            self._killed = proc
            proc.kill()
        return proc.pid, now, now + max(self.settings.restart_delay_s, down_s)

    def stop(self) -> None:
        """SIGTERM the Lighthouse (one process, no children) and SIGKILL it if it lingers."""
        self._stopping.set()
        with self._lock:
            proc = self.proc
        if proc and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(self.settings.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
