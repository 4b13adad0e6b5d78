"""Small files one process writes and another polls (beacons, injections, the connection file): written whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


def write_model(path: Path, model: BaseModel) -> None:
    """Atomically: a reader sees the old content or the new, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(model.model_dump_json())
    os.replace(tmp, path)


def write_private(path: Path, text: str) -> None:
    """Atomically, readable by this user alone (0600 from the first byte), without following a
    link planted at the temporary name or the path itself (the rename replaces a link, never writes through it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def read_model(path: Path, model: type[M]) -> M | None:
    """The file's model, or None when it is missing or not (yet) one."""
    try:
        return model.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None
