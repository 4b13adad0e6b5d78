from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its Rust logs every quorum

from cluster import TrainerGroup  # noqa: E402


@pytest.fixture
def lighthouse():
    """A real torchft Lighthouse on a free port, tuned for fast failure detection."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                              quorum_tick_ms=100, heartbeat_timeout_ms=1000)
    port = server.address().rsplit(":", 1)[1]
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


@pytest.fixture
def groups(tmp_path: Path):
    """Factory for replica-group processes; every one is ended after the test."""
    started: list[TrainerGroup] = []

    def make(group: int, args: list[str]) -> TrainerGroup:
        g = TrainerGroup(group, args, tmp_path / f"group{group}-{len(started)}.log")
        started.append(g)
        return g

    yield make
    for g in started:
        g.stop(timeout_s=10)
