"""Every process a test starts is ended when the test (or fixture, or session) ends.

A tree walk misses a process whose parent has already exited: it is re-parented to PID 1 and
no longer anybody's descendant. So each owner (a fixture; the whole session) tags what it starts
with an environment variable that every descendant inherits, and ends its processes by that tag,
by pid: it freezes them all first (SIGSTOP: a frozen supervisor cannot restart what it loses),
then SIGKILLs them.
"""

from __future__ import annotations

import os
import signal
import uuid

import psutil

from service.proctree import REAPED_S, wait_gone

OWNER = "FTCTL_TEST_OWNER"
SESSION = "FTCTL_TEST_SESSION"


def owned(variable: str, value: str) -> list[psutil.Process]:
    """The live processes (not this one) whose environment has ``variable=value``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(variable) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def end_owned(variable: str, value: str) -> list[int]:
    """Freeze, then SIGKILL, every process tagged ``variable=value``; returns the pids ended."""
    frozen: dict[int, psutil.Process] = {}
    while new := [p for p in owned(variable, value) if p.pid not in frozen]:
        for proc in new:
            try:
                proc.send_signal(signal.SIGSTOP)
                frozen[proc.pid] = proc
            except psutil.NoSuchProcess:
                pass
    for proc in frozen.values():
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    wait_gone(list(frozen), REAPED_S)
    return sorted(frozen)


class Owner:
    """Tags the processes started with :meth:`env`; ``end()`` ends every one of them."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, OWNER: self.id, **extra}

    def end(self) -> list[int]:
        return end_owned(OWNER, self.id)

    def __enter__(self) -> "Owner":
        return self

    def __exit__(self, *exc) -> None:
        self.end()
