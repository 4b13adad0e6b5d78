"""How an agent and its warm spare talk: files in the agent's run folder.

The agent starts each spare (generation n) with ``--spare-promote-file`` set to
:func:`promotion_file`. Every rank of the spare, once built, creates its :func:`readiness_file`
beside it; the spare is ready when every rank has. The agent promotes the spare by creating the
promotion file itself, after which the spare joins the quorum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator
from protocol.layout import GroupLayout


def promotion_file(run_dir: Path, group: int, generation: int) -> Path:
    return run_dir / GroupLayout(group).promotion(generation)


def readiness_file(promotion: Path, rank: int) -> Path:
    return promotion.with_name(f"{promotion.name}.ready-r{rank}")


def spare_files(run_dir: Path, group: int) -> Iterator[tuple[int | None, Path]]:
    """Every promotion and readiness file of ``group`` with its generation (None: unreadable)."""
    for path in run_dir.glob(GroupLayout(group).promotion_glob):
        generation = path.name.split(".")[2]
        yield (int(generation) if generation.isdigit() else None), path
