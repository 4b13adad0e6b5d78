"""Signalling a replica group's whole process tree.

torchrun starts every worker in a session of its own, so a process-group kill of torchrun
misses the ranks. The tree is walked instead (psutil), and every process in it is signalled
together, the way a node loss takes all of them at once.
"""

from __future__ import annotations

import signal

import psutil


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


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


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait for the pids to exit; returns those still alive."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive]
