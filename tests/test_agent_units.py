"""The agent's pieces that need no training processes."""

from __future__ import annotations

from pathlib import Path

from service.agent.spare import WarmSpare
from service.agent.supervisor import GroupCommand


def spare(tmp_path: Path) -> WarmSpare:
    return WarmSpare(GroupCommand(1, 2, [], None, tmp_path / "group1.log"), tmp_path, respawn_delay_s=0)


def test_a_new_spare_keeps_the_files_of_the_spare_promoted_before_it(tmp_path):
    s = spare(tmp_path)
    for generation in (1, 2, 3):
        for suffix in ("", ".ready-r0", ".ready-r1"):
            (tmp_path / f"group1.promote.{generation}{suffix}").touch()
    (tmp_path / "group0.promote.1").touch()
    s.generation = 3
    s.clean(keep_from=s.generation - 1)  # what launch() does for generation 3
    left = sorted(p.name for p in tmp_path.glob("group*.promote.*"))
    assert left == ["group0.promote.1", "group1.promote.2", "group1.promote.2.ready-r0", "group1.promote.2.ready-r1",
                    "group1.promote.3", "group1.promote.3.ready-r0", "group1.promote.3.ready-r1"]


def test_readiness_needs_every_rank(tmp_path):
    s = spare(tmp_path)
    s.generation = 1
    assert [p.name for p in s._ready_paths()] == ["group1.promote.1.ready-r0", "group1.promote.1.ready-r1"]
    assert s.state() is None and s.promote() is None  # no process: nothing to promote
