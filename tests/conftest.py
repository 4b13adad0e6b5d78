from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its Rust logs every quorum
os.environ["FTCTL_TEST_SESSION"] = uuid.uuid4().hex  # every process the tests start inherits it

from cluster import TrainerGroup  # noqa: E402
from processes import SESSION, Owner, end_owned  # noqa: E402
from protocol import defaults  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the last test, no process any test started is still running."""
    yield
    left = end_owned(SESSION, os.environ[SESSION])
    if left:
        pytest.fail(f"the tests left processes behind (ended now): {left}")


@pytest.fixture
def lighthouse():
    """A real torchft Lighthouse on a free port, tuned for fast failure detection."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=defaults.JOIN_TIMEOUT_MS,
                              quorum_tick_ms=defaults.QUORUM_TICK_MS,
                              heartbeat_timeout_ms=defaults.HEARTBEAT_TIMEOUT_MS)
    port = server.address().rsplit(":", 1)[1]
    yield f"http://127.0.0.1:{port}"
    server.shutdown()


@pytest.fixture
def groups(tmp_path: Path):
    """Factory for replica-group processes; every one is ended after the test, orphans included."""
    started: list[TrainerGroup] = []
    with Owner() as owner:

        def make(group: int, args: list[str], host: list[str] = ()) -> TrainerGroup:
            g = TrainerGroup(group, args, tmp_path / f"group{group}-{len(started)}.log", env=owner.env(),
                             host=list(host))
            started.append(g)
            return g

        yield make
        for g in started:
            g.stop(timeout_s=10)
