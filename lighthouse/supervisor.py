"""Keeps torchft's Lighthouse running: a child process, restarted whenever it dies."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from lighthouse.config import LighthouseSettings

log = logging.getLogger("lighthouse")


class LighthouseSupervisor:
    def __init__(self, settings: LighthouseSettings):
        self.settings = settings
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="lighthouse-watch", daemon=True)

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
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
            log.warning("lighthouse exited with %s; restarting in %.1fs", code, self.settings.restart_delay_s)
            if self._stopping.wait(self.settings.restart_delay_s):
                return
            self.restarts += 1
            self._spawn()

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
