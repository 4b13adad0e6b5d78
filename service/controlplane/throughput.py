"""Training throughput as the drills measure it: samples trained by committed steps, over time.

Each committed step says how many samples of its global batch it trained over every group
(``StepEvent.step_samples``); every group of the step says the same, so a step is counted once,
from its first report. Tokens are these samples times the job's sequence length. Counting
samples, not torchft's replica-batches, keeps the figure honest under ``--batch-policy
constant``: a step the survivors take alone trains the same batch as a step of every group.
"""

from __future__ import annotations

import statistics

from protocol.events import StepEvent


class ThroughputMeter:
    """Trained samples over time, and step times, from rank 0's committed step events (any group)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.samples = 0
        self.points: list[tuple[float, int]] = []
        self.step_s: list[tuple[float, float]] = []

    def observe(self, e: StepEvent) -> None:
        if e.step not in self.seen:
            self.seen.add(e.step)
            self.samples += e.step_samples
        self.points.append((e.ts, self.samples))
        self.step_s.append((e.ts, e.step_s))

    def rate(self, start: float, end: float) -> float | None:
        """Samples trained per second between the first and the last step inside [start, end]."""
        inside = [p for p in self.points if start <= p[0] <= end]
        if len(inside) < 2 or inside[-1][0] == inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def median_step_s(self, start: float, end: float) -> float | None:
        inside = [s for ts, s in self.step_s if start <= ts <= end]
        return statistics.median(inside) if inside else None
