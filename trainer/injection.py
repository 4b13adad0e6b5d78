"""Faults a drill injects into this rank at run time (``protocol/injection.py``), without a restart."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from protocol.injection import Injection, injection_file_name, read_injection

POLL_S = 0.1
"""How often the injection file is looked at: a drill's fault lands within a step or two."""


class InjectedFaults:
    """Watches the group's injection file; the training loop asks it for the fault due now."""

    def __init__(self, events_dir: Path, group: int):
        self.path = events_dir / injection_file_name(group)
        existing = read_injection(self.path)
        self._seen = existing.id if existing else 0  # injected before this start: not ours
        self._pending: Injection | None = None
        self._slow: Injection | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="ft-injections", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            injection = read_injection(self.path)
            if injection is not None and injection.id > self._seen:
                self._seen = injection.id
                if os.getpid() in injection.pids:
                    if injection.kind == "slow":
                        self._slow = injection
                    else:
                        self._pending = injection

    def stall(self) -> None:
        """Inside the step, before the forward: a ``stuck`` injection sleeps here once, as a rank
        stuck in Python would; a ``slow`` one sleeps its delay every step until it ends."""
        injection, self._pending = self._pending, None
        if injection is not None:
            time.sleep(injection.seconds)
        slow = self._slow
        if slow is not None:
            if time.time() < slow.until:
                time.sleep(slow.delay_s)
            else:
                self._slow = None

    def close(self) -> None:
        self._stop.set()
