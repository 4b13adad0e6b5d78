"""The line that says why a group's processes crashed, read from the group's log.

A group that crashes at start (a bad setting, a missing file) says why in one line of its log,
amid torchrun's banners and its ranks' tracebacks; the agent puts that line in the ``crashed``
event, so the terminal view, the page and ``ftctl status`` show it without anyone opening the log.
"""

from __future__ import annotations

import re
from pathlib import Path

MAX_LINE = 300
TAIL_BYTES = 64 * 1024
"""A crash's reason is near the end of the log: read at most this much of what the start wrote."""
ONE_LINE_ERROR = re.compile(r"\b[\w.]+: error: (.+)")
"""How this project's commands say what is wrong: ``trainer: error: …``."""
EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)\b.*)$")
CPP_EXCEPTION = re.compile(r"what\(\):\s*(.+)")
"""A C++ exception that ended a process (``terminate called after throwing …``)."""
LAUNCHER_SUMMARY = ("ChildFailedError",)
"""torchrun's own summary of a failed rank: it names the rank, not the reason."""
SEPARATOR = re.compile(r"^[=\-_*#]+$")


def crash_line(text: str) -> str | None:
    """This project's one-line error if the log has one, else the last exception a rank raised
    (Python's, then C++'s), else the last line that says something; None for an empty log."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if found := ONE_LINE_ERROR.search(line):
            return _cut(f"error: {found.group(1)}")
    for line in reversed(lines):
        found = EXCEPTION.match(line)
        if found and not any(s in found.group(1).split(":")[0] for s in LAUNCHER_SUMMARY):
            return _cut(found.group(1))
    for line in reversed(lines):
        if found := CPP_EXCEPTION.search(line):
            return _cut(f"C++ exception: {found.group(1)}")
    said = [line for line in lines if not SEPARATOR.match(line)]
    return _cut(said[-1]) if said else None


def _cut(line: str) -> str:
    return line if len(line) <= MAX_LINE else line[:MAX_LINE - 1] + "…"


def read_crash_line(log: Path, offset: int) -> str | None:
    """:func:`crash_line` of what the group's start wrote to ``log`` after ``offset``."""
    try:
        with open(log, "rb") as f:
            f.seek(max(offset, f.seek(0, 2) - TAIL_BYTES))
            return crash_line(f.read().decode(errors="replace"))
    except OSError:
        return None


def log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0
