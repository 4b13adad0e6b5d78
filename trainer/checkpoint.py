"""Periodic checkpoints with torch.distributed.checkpoint, published atomically.

A checkpoint is written by every rank of one group into ``.step-N.tmp-gG``; when DCP has
finished (its metadata is written last, after a gather), the group's rank 0 writes a
manifest with the size and SHA-256 of every file and renames the folder to ``step-N``.
A folder without a manifest, or whose files do not match it, is never loaded: the loader
warns and falls back to the next newest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(folder: Path) -> str | None:
    """None when the checkpoint is complete, else why it is not."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"unreadable manifest: {err}"
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {expected['size']}"
        if _file_digest(path) != expected["sha256"]:
            return f"{name} does not match its SHA-256"
    return None


@dataclass(frozen=True)
class Found:
    step: int
    path: Path


def newest_complete(root: Path, warn) -> Found | None:
    """The newest verified checkpoint under ``root``; ``warn(path, reason)`` for each skipped."""
    if not root.is_dir():
        return None
    candidates = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")),
                        key=lambda p: p.name, reverse=True)
    for folder in candidates:
        reason = verify(folder)
        if reason is None:
            return Found(int(folder.name.removeprefix("step-")), folder)
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
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
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
        complete = sorted((p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step-")),
                          key=lambda p: p.name)
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
        names = [p.name for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step-")] if self.root.is_dir() else []
        return max(names, default=None)

    def choose(self, warn) -> Found | None:
        """Rank 0 picks the newest complete checkpoint; every rank of the group gets its pick."""
        pick: list[Found | None] = [newest_complete(self.root, warn) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(pick, src=0)
        return pick[0]
