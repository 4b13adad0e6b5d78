"""Periodic checkpoints with torch.distributed.checkpoint, written off the step, published atomically.

A checkpoint is written by every rank of one group into ``.step-N.tmp-gG``; when DCP has
finished (its metadata is written last, after a gather), the group's rank 0 writes a
manifest with the size and SHA-256 of every file and renames the folder to ``step-N``.
A folder without a manifest, or whose files do not match it, is never loaded: the loader
warns and falls back to the next newest.

Off the step (the default): ``dcp.async_save`` with its thread executor. The state is copied
(staged) into CPU memory by a staging thread while the next step computes, and the files are
written by a background thread whose collectives run on a process group of their own, so they
never interleave with FSDP's. The copy must be complete before anything changes the state in
place: the trainer calls :meth:`Checkpointer.fence` before its optimizer step and before a heal
loads a peer's state, and the step stalls only if the copy is not done by then. The checkpoint is published when the write has finished, at the next :meth:`poll`
after it (every step polls); a group that dies before that leaves an unpublished folder, which
is never loaded. One save is in flight at a time: a save due while the previous one still
writes waits for it (that wait is part of the step's stall). torchtitan's async mode stages
into pinned memory, which needs an accelerator; the default stager here copies into plain
CPU memory, which works everywhere.
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
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from protocol.layout import GroupLayout

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


SEMI_SYNC_KEY = "semi_sync"
"""The top-level entry of a checkpoint written with --sync localsgd|diloco (``SemiSync.checkpoint_state``)."""


def written_semi_sync(folder: Path) -> bool | None:
    """Whether the checkpoint in ``folder`` was written by a --sync localsgd|diloco job (it holds the
    synced point and the outer optimizer), read from its DCP metadata; None where that cannot be
    read (the load, which verifies the checkpoint's files first, says what is wrong with it)."""
    try:
        keys = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except OSError:
        return None
    return any(key.split(".", 1)[0] == SEMI_SYNC_KEY for key in keys)


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


@dataclass(frozen=True)
class Saved:
    """A checkpoint published (by rank 0) or written (by this rank): ``seconds`` from its start to
    now, ``stall_s`` the part the training step waited for."""

    step: int
    path: Path
    seconds: float
    stall_s: float


@dataclass
class _InFlight:
    step: int
    staging: Path
    final: Path
    started: float
    stall_s: float
    written: Future


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
                 restore: Callable[[dict[str, Any]], None], asynchronous: bool = True,
                 timeout: timedelta = timedelta(minutes=10)):
        """``state()`` gives the tensors (DTensors allowed) and values to save; after a load
        fills them in place, ``restore(state)`` applies the non-tensor values. A checkpoint is
        due every ``every`` committed steps; the newest ``keep`` are kept. Collective (with
        ``asynchronous``, it makes the background writes' process group, whose collectives give
        up after ``timeout``: a write whose peer rank died fails instead of waiting forever)."""
        self.root = root
        self.group = group
        self.keep = keep
        self.every = every
        self.state = state
        self.restore = restore
        self.writes_group = dist.new_group(backend="gloo", timeout=timeout) if asynchronous else None
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False)
                                    ) if asynchronous else None
        self._in_flight: _InFlight | None = None
        self._staged: Future | None = None

    def _staging(self, final: Path) -> Path:
        return self.root / GroupLayout(self.group).checkpoint_staging(final.name)

    def clear_unpublished(self) -> None:
        """Rank 0 removes this group's folders of saves that never finished (a crash mid-write): a
        save writes into its folder without emptying it first, so no earlier try may be left there.
        Only where no other process of the group may be writing: never from a warm spare waiting
        beside the live group, whose save in flight is such a folder too."""
        if dist.get_rank() == 0 and self.root.is_dir():
            for folder in self.root.glob(GroupLayout(self.group).checkpoint_staging_glob):
                shutil.rmtree(folder, ignore_errors=True)

    def due(self, step: int, since: int) -> bool:
        """A save is due at committed step ``step`` when a multiple of ``every`` lies in (since, step]."""
        return step // self.every > since // self.every

    def save(self, step: int) -> tuple[float, list[Saved]]:
        """Collective over the group's ranks: start saving ``step``. Returns the seconds the step
        stalled and the saves it completed meanwhile: the previous one, waited for; this one when
        synchronous. An asynchronous save completes at a later :meth:`poll` or :meth:`wait`."""
        start = time.perf_counter()
        done = self.wait()
        final = self.root / step_dir_name(step)
        staging = self._staging(final)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if dist.get_rank() == 0:
            with contextlib.suppress(PermissionError):  # a shared folder of another owner keeps its mode
                os.chmod(self.root, 0o700)  # the model and optimizer: this user's alone
        staging.mkdir(exist_ok=True)
        if self.writes_group is None:
            dcp.save(self.state(), checkpoint_id=staging)
            stall = time.perf_counter() - start
            return stall, [*done, self._complete(step, staging, final, start, stall)]
        response = dcp.async_save(self.state(), checkpoint_id=staging, process_group=self.writes_group,
                                  async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                  async_stager=self.stager)
        stall = time.perf_counter() - start
        self._staged = response.staging_completion
        self._in_flight = _InFlight(step, staging, final, start, stall, response.upload_completion)
        return stall, done

    def fence(self) -> float:
        """Wait until the save in flight holds its own copy of the state. Call it before anything
        changes the state in place (an optimizer step, a heal's load): a change before would reach
        the checkpoint. Returns the seconds waited, a stall of the step (counted in the save's too)."""
        staged, self._staged = self._staged, None
        if staged is None:
            return 0.0
        began = time.perf_counter()
        staged.result()
        waited = time.perf_counter() - began
        if self._in_flight is not None:
            self._in_flight.stall_s += waited
        return waited

    def poll(self) -> list[Saved]:
        """The save in flight when its write has finished (published by rank 0), else nothing.
        A failed write raises here, as a synchronous save would have raised in :meth:`save`."""
        if self._in_flight is None or not self._in_flight.written.done():
            return []
        return self.wait()

    def wait(self) -> list[Saved]:
        """Wait for the save in flight, if any, and publish it."""
        self._staged = None  # written implies staged
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        in_flight.written.result()
        return [self._complete(in_flight.step, in_flight.staging, in_flight.final, in_flight.started, in_flight.stall_s)]

    def _complete(self, step: int, staging: Path, final: Path, started: float, stall_s: float) -> Saved:
        """Rank 0 writes the manifest and publishes; every rank reports its part done."""
        if dist.get_rank() == 0:
            files = {p.name: {"size": p.stat().st_size, "sha256": _file_digest(p)}
                     for p in sorted(staging.iterdir()) if p.is_file()}
            (staging / MANIFEST).write_text(json.dumps({"step": step, "group": self.group, "files": files}))
            self._publish(staging, final)
            self._prune()
        return Saved(step, final, time.perf_counter() - started, stall_s)

    def _publish(self, staging: Path, final: Path) -> None:
        if final.exists():  # the same step saved again after a restart: replace it
            old = final.with_name(GroupLayout(self.group).checkpoint_replaced(final.name))
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

    def close(self, finish: bool) -> list[Saved]:
        """Finish the save in flight (``finish``: a graceful exit publishes it; else it is left
        unpublished, as a crash would leave it) and free the writes' group."""
        done = self.wait() if finish else []
        self._in_flight = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.writes_group is not None:
            dist.destroy_process_group(self.writes_group)
            self.writes_group = None
        return done

    def choose(self, warn, clear_unpublished: bool = True) -> Found | None:
        """Rank 0 picks the newest complete checkpoint (having cleared unfinished saves, with
        ``clear_unpublished``); every rank of the group gets its pick, or the same error (a rank 0
        that failed alone would leave the others waiting for its pick)."""
        pick: list[Found | str | None] = [None]
        if dist.get_rank() == 0:
            try:
                if clear_unpublished:
                    self.clear_unpublished()
                pick[0] = newest_complete(self.root, warn)
            except OSError as err:
                pick[0] = f"cannot read the checkpoints in {self.root}: {err}"
        dist.broadcast_object_list(pick, src=0)
        if isinstance(pick[0], str):
            raise OSError(pick[0])
        return pick[0]
