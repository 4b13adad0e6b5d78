"""Partitions between groups that all still reach the Lighthouse: which groups go on.

torchft knows nothing of which pairs of groups can talk. When two groups cannot reach each other
but both still heartbeat to the Lighthouse, every quorum takes them both back in, every
cross-group all-reduce times out, every commit fails, and the whole job loops without a single
step (the issue measured 103 s of it, and a group crashed in it). Something outside torchft has to
break the loop: here the control plane, which reaches every agent.

When the groups stall or a commit fails, the control plane asks every up group's agent which
other groups' agents it reaches (a TCP connection to each, from the group's own host: ``POST
/probe``; ``partition_responder.py``). Two groups *reach each other* when either reached the
other: a TCP handshake needs packets both ways, so one success proves the path, while one side's
failure alone may be its own (an agent too busy to finish within the timeout); a pair is cut
when both fail. :func:`survivors` is the rule: **keep the largest set of groups that all reach
each other; among sets as large, the one whose sorted group numbers come first**. Every other up group that answered is evicted, as a hung group is ended, and comes
back when its agent reaches every training group again. A group whose agent does not answer is
no part of the decision: it is lost, or cut off from everyone, and the Lighthouse already leaves
it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_BRANCHES = 100_000
"""The exact search's budget: a cut of a few pairs among hundreds of groups needs a handful of
branches; past the budget the answer is the greedy one (largest first, by group number)."""


@dataclass(frozen=True)
class PartitionVerdict:
    keep: tuple[int, ...]
    evict: tuple[int, ...]
    cut: tuple[tuple[int, int], ...]
    """the pairs of answering groups that do not reach each other"""

    @property
    def partitioned(self) -> bool:
        return bool(self.evict)


def linked(reached: Mapping[int, Mapping[int, bool]]) -> dict[int, set[int]]:
    """Who reaches whom, among the groups that answered (a row each): either side's success counts."""
    groups = set(reached)
    return {g: {h for h in groups - {g} if reached[g].get(h) or reached[h].get(g)} for g in groups}


def survivors(reached: Mapping[int, Mapping[int, bool]]) -> PartitionVerdict:
    """The rule: the largest set of answering groups that all reach each other (ties: the sorted
    group numbers that come first) is kept; the other answering groups are evicted."""
    links = linked(reached)
    groups = sorted(links)
    cut = tuple((g, h) for i, g in enumerate(groups) for h in groups[i + 1:] if h not in links[g])
    if not cut:
        return PartitionVerdict(tuple(groups), (), ())
    keep = _largest_clique(links)
    return PartitionVerdict(keep, tuple(g for g in groups if g not in keep), cut)


def _largest_clique(links: Mapping[int, set[int]]) -> tuple[int, ...]:
    """Bron–Kerbosch with a pivot, keeping the best clique by (size, then the smaller sorted tuple)."""
    best: tuple[int, ...] = ()
    branches = 0

    def better(clique: tuple[int, ...]) -> bool:
        return len(clique) > len(best) or (len(clique) == len(best) and clique < best)

    def expand(clique: list[int], candidates: set[int], excluded: set[int]) -> None:
        nonlocal best, branches
        branches += 1
        if not candidates and not excluded:
            found = tuple(sorted(clique))
            if better(found):
                best = found
            return
        if len(clique) + len(candidates) < len(best) or branches > MAX_BRANCHES:
            return
        pivot = max(candidates | excluded, key=lambda g: len(links[g] & candidates))
        for g in sorted(candidates - links[pivot]):
            expand([*clique, g], candidates & links[g], excluded & links[g])
            candidates = candidates - {g}
            excluded = excluded | {g}

    expand([], set(links), set())
    if branches > MAX_BRANCHES:
        greedy = _greedy_clique(links)
        if better(greedy):
            best = greedy
    return best


def _greedy_clique(links: Mapping[int, set[int]]) -> tuple[int, ...]:
    clique: list[int] = []
    for g in sorted(links, key=lambda g: (-len(links[g]), g)):
        if all(g in links[h] for h in clique):
            clique.append(g)
    return tuple(sorted(clique))
