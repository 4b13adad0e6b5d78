"""Signalling a replica group's whole process tree.

torchrun starts every worker in a session of its own, so a process-group kill of torchrun
misses the ranks. The tree is walked instead (psutil), and every process in it is signalled
together, the way a node loss takes all of them at once.
"""

from __future__ import annotations

import signal
import time
from typing import Protocol

import psutil

REAPED_S = 5.0
"""After SIGKILL a process is gone within milliseconds; waiting longer means it is stuck in the kernel."""


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def descends_from(pid: int, root: int) -> bool:
    """Whether ``pid`` is ``root`` or one of its descendants: a walk up from ``pid`` (a few reads
    of /proc), where listing ``root``'s tree means reading every process on the node."""
    try:
        return pid == root or any(p.pid == root for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


def signal_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``pid`` and all its descendants; returns the pids signalled."""
    signalled = []
    for proc in process_tree(pid):
        try:
            proc.send_signal(sig)
            signalled.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return signalled


def kill_tree(pid: int) -> list[int]:
    """SIGKILL a process and every descendant at once, like losing the node, and wait until
    they are gone (at most :data:`REAPED_S`); returns the pids signalled."""
    pids = signal_tree(pid, signal.SIGKILL)
    wait_gone(pids, REAPED_S)
    return pids


class Waitable(Protocol):
    """A child to reap: a ``subprocess.Popen``, or a group the agent's zygote forked."""

    pid: int

    def wait(self, timeout: float | None = None) -> int | None: ...


def end_tree(proc: Waitable | int, grace_s: float) -> list[int]:
    """SIGTERM the root, give the tree ``grace_s`` to exit, then SIGKILL whatever is left.

    The root stops its children its own way (torchrun forwards the signal to the ranks, an
    agent stops its group, ``ftctl up`` its services). The tree is taken before the signal, so
    a child orphaned when the root exits is still ended, by pid. Returns the pids still alive
    afterwards (none, normally); reaps ``proc`` unless it is a bare pid.
    """
    root = proc if isinstance(proc, int) else proc.pid
    pids = [p.pid for p in process_tree(root)]
    if pids:
        try:
            psutil.Process(root).send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    left = [pid for pid in wait_gone(pids, grace_s) for pid in signal_tree(pid, signal.SIGKILL)]
    if not isinstance(proc, int):
        proc.wait()
    return wait_gone(sorted(set(left)), REAPED_S)


def wait_gone(pids: list[int], timeout_s: float, poll_s: float = 0.01) -> list[int]:
    """Wait for the pids to exit; returns those still alive.

    A zombie counts as gone: it holds no memory, sockets or devices any more, only a pid
    until its parent reaps it. The ranks of a killed torchrun are orphans, and whoever
    inherits them (PID 1 of a container, often) may reap them late or never; waiting for
    the reap delayed every fail-over here by 1-2 s.
    """
    deadline = time.monotonic() + timeout_s
    alive = [proc for pid in pids if (proc := _process(pid)) is not None]
    while True:
        alive = [proc for proc in alive if _running(proc)]
        if not alive or time.monotonic() >= deadline:
            return [proc.pid for proc in alive]
        time.sleep(poll_s)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie; ``is_running`` also tells a reused pid from the process we meant."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
