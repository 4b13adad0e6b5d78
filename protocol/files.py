"""Small files one process writes and another polls (beacons, injections): written whole."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel


def write_model(path: Path, model: BaseModel) -> None:
    """Atomically: a reader sees the old content or the new, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(model.model_dump_json())
    os.replace(tmp, path)
