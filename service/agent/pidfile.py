"""The pid files an agent leaves for the agent after it: which torchrun trees are its group's.

A bare pid is not enough: after a crash of the agent and a reboot or a long wait, the number may
belong to a stranger's process, and the next agent would kill it. So a record holds the pid, the
process's start time (which a reused pid does not share) and the group; an agent kills what a
record names only when all three match, and removes the record once the process has ended.
"""

from __future__ import annotations

import logging
from pathlib import Path

import psutil
from pydantic import BaseModel

from protocol.files import read_model, write_model
from service.proctree import kill_tree

log = logging.getLogger("agent.pidfile")
SAME_START_S = 0.05
"""Two start times this close are the same process (psutil reports them to 10 ms)."""


class PidRecord(BaseModel):
    pid: int
    started: float
    """the process's start time, as psutil reads it"""
    group: int


def record_pid(path: Path, pid: int, group: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_model(path, PidRecord(pid=pid, started=psutil.Process(pid).create_time(), group=group))


def forget_pid(path: Path, pid: int) -> None:
    """Remove the record of ``pid`` (an ended process); a record of another is kept."""
    record = read_model(path, PidRecord)
    if record is not None and record.pid == pid:
        path.unlink(missing_ok=True)


def reap_pidfile(path: Path, group: int) -> list[int]:
    """SIGKILL the torchrun tree a record names when it is still the process recorded (its agent
    died and left it); returns the pids killed. The record is gone afterwards either way."""
    record = read_model(path, PidRecord)
    path.unlink(missing_ok=True)
    if record is None or record.group != group:
        return []
    try:
        started = psutil.Process(record.pid).create_time()
    except psutil.Error:
        return []
    if abs(started - record.started) > SAME_START_S:
        log.info("pid %d of %s is another process now (started %.2f, not %.2f): left alone",
                 record.pid, path.name, started, record.started)
        return []
    log.warning("killing torchrun %d left behind by a previous agent (%s)", record.pid, path.name)
    return kill_tree(record.pid)
