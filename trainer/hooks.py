"""The training loop's drill hooks: where a drill's fault lands in this rank, without a restart.

The loop calls the hooks at fixed points of every step: :meth:`DrillHooks.stall` before the
forward (a hang, a straggler's delay), :meth:`DrillHooks.corrupt` on each gradient buffer before
it leaves the rank (silent data corruption, where a bad chip would put it), :attr:`DrillHooks.watched`
after the check (report the update norms). Each does nothing until a drill writes the group's
injection file (``protocol/injection.py``): a job nobody drills pays one attribute read per point.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

from protocol.layout import GroupLayout
from protocol.injection import Injection, read_injection

POLL_S = 0.1
"""How often the injection file is looked at: a drill's fault lands within a step or two."""


class DrillHooks:
    """Watches the group's injection file; the training loop asks it for the fault due now."""

    def __init__(self, events_dir: Path, group: int):
        self.path = events_dir / GroupLayout(group).injection
        existing = read_injection(self.path)
        self._seen = existing.id if existing else 0  # injected before this start: not ours
        self._pending: Injection | None = None
        self._slow: Injection | None = None
        self._corrupt: Injection | None = None
        self._watch_until = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="ft-injections", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            injection = read_injection(self.path)
            if injection is not None and injection.id > self._seen:
                self._seen = injection.id
                if os.getpid() in injection.pids:
                    match injection.kind:
                        case "slow":
                            self._slow = injection
                        case "corrupt":
                            self._corrupt = injection
                        case "watch":
                            self._watch_until = injection.until
                        case _:
                            self._pending = injection

    def stall(self, step: int) -> None:
        """Inside step ``step``, before the forward: a ``stuck`` injection sleeps here once, as a
        rank stuck in Python would; a ``slow`` one sleeps its delay at each of its steps until it ends."""
        injection, self._pending = self._pending, None
        if injection is not None:
            time.sleep(injection.seconds)
        slow = self._slow
        if slow is not None:
            if time.time() < slow.until:
                if step % slow.every == slow.offset:
                    time.sleep(slow.delay_s)
            else:
                self._slow = None

    def corrupt(self, gradient: torch.Tensor) -> bool:
        """Silent data corruption, where a bad chip would put it: multiply the largest element of
        this gradient shard by the injection's scale, once (or every call while a persistent one
        lasts). The largest, so that the drill's fault is one a norm can see; returns whether it did."""
        corrupt = self._corrupt
        if corrupt is None:
            return False
        if not corrupt.persistent or time.time() >= corrupt.until:
            self._corrupt = None
            if corrupt.persistent:
                return False
        flat = gradient.view(-1)
        flat[flat.abs().argmax()] *= corrupt.scale
        return True

    @property
    def watched(self) -> bool:
        """A drill asked for this rank's update norms."""
        return time.time() < self._watch_until

    def close(self) -> None:
        self._stop.set()
