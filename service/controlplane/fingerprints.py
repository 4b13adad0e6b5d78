"""Comparing the groups' state fingerprints: one book, read by the metrics and the drills.

Every ``--fingerprint-every`` committed steps each rank reports a digest of its parameter and
optimizer shards. Rank r of every group holds the same shard, so equal digests for
(step, rank) across groups mean the groups hold bitwise identical state.
"""

from __future__ import annotations

from protocol.events import FingerprintEvent


class FingerprintBook:
    def __init__(self, keep_steps: int | None = None):
        """Keeps the newest ``keep_steps`` steps (all, when None)."""
        self.keep_steps = keep_steps
        self.by_step: dict[int, dict[tuple[int, int], str]] = {}

    def add(self, e: FingerprintEvent) -> None:
        self.by_step.setdefault(e.step, {})[(e.group, e.rank)] = e.digest
        if self.keep_steps is not None:
            for old in sorted(self.by_step)[:-self.keep_steps]:
                del self.by_step[old]

    def groups_at(self, step: int) -> set[int]:
        return {g for g, _ in self.by_step.get(step, {})}

    def equal_at(self, step: int) -> bool:
        """Every rank reported one digest across the groups that reported at ``step``."""
        by_rank: dict[int, set[str]] = {}
        for (_, rank), digest in self.by_step.get(step, {}).items():
            by_rank.setdefault(rank, set()).add(digest)
        return all(len(digests) == 1 for digests in by_rank.values())

    def complete_step(self, groups: set[int], ranks_per_group: int, from_step: int) -> int | None:
        """The first step from ``from_step`` on at which every rank of every one of ``groups`` reported."""
        wanted = {(g, r) for g in groups for r in range(ranks_per_group)}
        return min((step for step, seen in self.by_step.items() if step >= from_step and wanted <= seen.keys()),
                   default=None)

    def digests(self, step: int, groups: set[int], ranks_per_group: int) -> dict[str, dict[str, str]]:
        """group → rank → digest at ``step``, as a report shows them."""
        seen = self.by_step[step]
        return {str(g): {str(r): seen[(g, r)] for r in range(ranks_per_group)} for g in sorted(groups)}
