"""Periodic checkpoints with torch.distributed.checkpoint, published atomically.

A checkpoint is written by every rank of one group into ``.step-N.tmp-gG``; when DCP has
finished (its metadata is written last, after a gather), the group's rank 0 writes a
manifest with the size and SHA-256 of every file and renames the folder to ``step-N``.
A folder without a manifest, or whose files do not match it, is never loaded: the loader
warns and falls back to the next newest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


STEP_DIR = re.compile(r"step-(\d{8,})")
"""A published checkpoint's folder, exactly: ``step-00000050.bak`` or ``step-x`` is none."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(folder: Path) -> int | None:
    """The step a published checkpoint folder holds, or None for any other name."""
    found = STEP_DIR.fullmatch(folder.name)
    return int(found.group(1)) if found and folder.is_dir() else None


def published(root: Path) -> list[Path]:
    """The published checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if step_of(p) is not None), key=step_of)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(folder: Path) -> str | None:
    """None when the checkpoint is complete and is what its name says, else why it is not. Any
    surprise (a manifest of another shape, a file it does not list) is a reason, never an error."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step = manifest["files"], manifest["step"]
        if not isinstance(files, dict) or not files:
            return "the manifest lists no files"
        if step != step_of(folder):
            return f"the manifest is of step {step}, the folder's name says {step_of(folder)}"
        present = {p.name for p in folder.iterdir() if p.name != MANIFEST}
        if unlisted := sorted(present - set(files)):
            return f"{unlisted[0]} is not in the manifest"
        for name, expected in files.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != expected["size"]:
                return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['size']}"
            if _file_digest(path) != expected["sha256"]:
                return f"{name} does not match its SHA-256"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"unreadable manifest: {type(err).__name__}: {err}"
    return None


@dataclass(frozen=True)
class Found:
    step: int
    path: Path


def newest_complete(root: Path, warn) -> Found | None:
    """The newest verified checkpoint under ``root``; ``warn(path, reason)`` for each skipped."""
    for folder in reversed(published(root)):
        reason = verify(folder)
        if reason is None:
            return Found(step_of(folder), folder)
        warn(folder, reason)
    return None


class Checkpointer:
    """Saves and loads the whole training state of one replica group."""

    def __init__(self, root: Path, group: int, keep: int, every: int, state: Callable[[], dict[str, Any]],
                 restore: Callable[[dict[str, Any]], None]):
        """``state()`` gives the tensors (DTensors allowed) and values to save; after a load
        fills them in place, ``restore(state)`` applies the non-tensor values. A checkpoint is
        due every ``every`` committed steps; the newest ``keep`` are kept."""
        self.root = root
        self.group = group
        self.keep = keep
        self.every = every
        self.state = state
        self.restore = restore

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int) -> tuple[Path, float]:
        """Collective over the group's ranks. Returns the published folder and seconds taken."""
        start = time.perf_counter()
        final = self.root / step_dir_name(step)
        staging = self.root / f".{final.name}.tmp-g{self.group}"
        rank = dist.get_rank()
        if rank == 0:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(PermissionError):  # a shared folder of another owner keeps its mode
                os.chmod(self.root, 0o700)  # the model and optimizer: this user's alone
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
        dist.barrier()
        dcp.save(self.state(), checkpoint_id=staging)
        if rank == 0:
            files = {p.name: {"size": p.stat().st_size, "sha256": _file_digest(p)}
                     for p in sorted(staging.iterdir()) if p.is_file()}
            (staging / MANIFEST).write_text(json.dumps({"step": step, "group": self.group, "files": files}))
            self._publish(staging, final)
            self._prune()
        return final, time.perf_counter() - start

    def _publish(self, staging: Path, final: Path) -> None:
        if final.exists():  # the same step saved again after a restart: replace it
            old = final.with_name(f".{final.name}.old-g{self.group}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, final)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _prune(self) -> None:
        complete = published(self.root)
        for folder in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(folder, ignore_errors=True)

    def load(self, folder: Path) -> float:
        """Collective over the group's ranks: load ``folder`` in place, then restore."""
        start = time.perf_counter()
        state = self.state()
        dcp.load(state, checkpoint_id=folder)
        self.restore(state)
        return time.perf_counter() - start

    def newest_name(self) -> str | None:
        """The newest published checkpoint's folder name, unverified (a cheap listing)."""
        folders = published(self.root)
        return folders[-1].name if folders else None

    def choose(self, warn) -> Found | None:
        """Rank 0 picks the newest complete checkpoint; every rank of the group gets its pick, or
        the same error (a rank 0 that failed alone would leave the others waiting for its pick)."""
        pick: list[Found | str | None] = [None]
        if dist.get_rank() == 0:
            try:
                pick[0] = newest_complete(self.root, warn)
            except OSError as err:
                pick[0] = f"cannot read the checkpoints in {self.root}: {err}"
        dist.broadcast_object_list(pick, src=0)
        if isinstance(pick[0], str):
            raise OSError(pick[0])
        return pick[0]
