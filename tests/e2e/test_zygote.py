"""The zygote: groups forked from a process that paid for the imports once, against a real
Lighthouse, with real signals; and the rank environment it gives, against real torchrun's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from cluster import committed_steps, read_events, wait_for
from processes import OWNER, Owner

from protocol.torchrun import free_port, rank_env, torchrun_argv
from service.agent.zygote import ForkedGroup, Zygote
from service.proctree import wait_gone

SMALL = ["--ranks-per-group", "2", "--seq-len", "64", "--local-batch-size", "1", "--fingerprint-every", "1"]
AGENT_ONLY = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
"""What torchrun's own agent adds for itself: its store (rank 0 hosts it instead), its error files
and its signal list; nothing of this trainer or of torchft reads them."""


@pytest.fixture
def owner(monkeypatch):
    """Tags every process the zygote starts, and ends them after the test."""
    with Owner() as owned:
        monkeypatch.setenv(OWNER, owned.id)
        yield owned


def args(lighthouse: str, tmp_path: Path, steps: int) -> list[str]:
    return ["--lighthouse", lighthouse, "--group", "0", "--groups", "1", "--steps", str(steps),
            "--events-dir", str(tmp_path / "events"), *SMALL]


def spawn(zygote: Zygote, trainer_args: list[str], tmp_path: Path) -> ForkedGroup:
    forked = zygote.spawn("test group", trainer_args, 2, "127.0.0.1", free_port(), tmp_path / "group.log")
    assert forked is not None, (tmp_path / "group.log").read_text()
    return forked


def test_a_forked_rank_gets_the_environment_torchrun_gives(tmp_path):
    script = tmp_path / "env.py"
    # one write per rank: under PYTHONUNBUFFERED, print() writes the newline apart, and two ranks'
    # lines on torchrun's one pipe could interleave
    script.write_text("import json, os, sys\nsys.stdout.write(json.dumps(dict(os.environ)) + '\\n')\n")
    port = free_port()
    argv = torchrun_argv(2, [], "127.0.0.1", port)
    assert argv[-2:] == ["-m", "trainer"]
    argv[-2:] = [str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    for line in out.stdout.splitlines():
        real = json.loads(line)
        ours = rank_env(base, int(real["RANK"]), 2, "127.0.0.1", port)
        added = {k: v for k, v in real.items() if base.get(k) != v and k not in AGENT_ONLY}
        assert added == {k: v for k, v in ours.items() if base.get(k) != v}


def test_a_forked_group_trains_and_a_failed_rank_ends_it_as_torchrun_would(lighthouse, tmp_path, owner):
    zygote = Zygote(0, args(lighthouse, tmp_path, 100_000), tmp_path / "group.log")
    try:
        group = spawn(zygote, args(lighthouse, tmp_path, 100_000), tmp_path)
        wait_for(lambda: len(committed_steps(read_events(tmp_path / "events"), 0)) >= 3, 120, "3 committed steps")
        starts = [e for e in read_events(tmp_path / "events") if e["type"] == "start"]
        assert {e["rank"] for e in starts} == {0, 1}
        assert all(e["forked"] and e["imports_s"] < 1.0 and e["data_s"] < 0.5 for e in starts), starts
        ranks = psutil.Process(group.pid).children()
        assert len(ranks) == 2 and group.poll() is None
        ranks[1].send_signal(signal.SIGKILL)
        assert group.wait(timeout=60) == 128 + signal.SIGKILL
        assert wait_gone([group.pid, ranks[0].pid], 5) == []
        assert "exited with -9; ending the group's other ranks" in (tmp_path / "group.log").read_text()

        finished = spawn(zygote, args(lighthouse, tmp_path, 3), tmp_path)  # the zygote forks again
        assert finished.wait(timeout=120) == 0
        exits = [e for e in read_events(tmp_path / "events") if e["type"] == "exit"]
        assert [e["reason"] for e in exits[-2:]] == ["done", "done"]
    finally:
        zygote.stop()
    assert not zygote.socket_path.parent.exists()


def test_sigterm_to_the_leader_stops_the_ranks_after_their_step(lighthouse, tmp_path, owner):
    zygote = Zygote(0, args(lighthouse, tmp_path, 100_000), tmp_path / "group.log")
    try:
        group = spawn(zygote, args(lighthouse, tmp_path, 100_000), tmp_path)
        wait_for(lambda: len(committed_steps(read_events(tmp_path / "events"), 0)) >= 2, 120, "2 committed steps")
        os.kill(group.pid, signal.SIGTERM)
        assert group.wait(timeout=60) == 0
        exits = [e for e in read_events(tmp_path / "events") if e["type"] == "exit"]
        assert sorted(e["reason"] for e in exits) == ["stopped", "stopped"]
    finally:
        zygote.stop()


def test_a_zygote_that_dies_takes_its_groups_along_and_the_next_start_gets_a_new_one(lighthouse, tmp_path, owner):
    zygote = Zygote(0, args(lighthouse, tmp_path, 100_000), tmp_path / "group.log")
    try:
        group = spawn(zygote, args(lighthouse, tmp_path, 100_000), tmp_path)
        ranks = psutil.Process(group.pid).children()
        first = zygote.proc.pid
        zygote.proc.send_signal(signal.SIGKILL)
        assert group.wait(timeout=30) == -signal.SIGKILL
        assert wait_gone([group.pid, *(r.pid for r in ranks)], 5) == []
        again = spawn(zygote, args(lighthouse, tmp_path, 2), tmp_path)
        assert zygote.proc.pid != first
        assert again.wait(timeout=120) == 0
    finally:
        zygote.stop()


def test_a_zygote_that_cannot_start_answers_none_so_the_agent_uses_torchrun(tmp_path, owner):
    zygote = Zygote(0, ["--config", "no_such_config", "--group", "0"], tmp_path / "group.log")
    try:
        assert zygote.spawn("test", ["--group", "0"], 2, "127.0.0.1", free_port(), tmp_path / "group.log") is None
        assert "unknown --config 'no_such_config'" in (tmp_path / "group.log").read_text()
    finally:
        zygote.stop()


def test_the_zygote_refuses_to_serve_with_threads_running(tmp_path):
    """Forking copies only the forking thread; a lock another thread held stays held forever in the
    child. The zygote checks it has one thread left after its imports."""
    code = ("import threading, time, sys; from trainer import zygote; "
            "zygote.preload = lambda args: threading.Thread(target=time.sleep, args=(30,), daemon=True).start() or 0.0; "
            f"zygote.main([{str(tmp_path / 's')!r}, '--'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "2 threads after the imports" in out.stderr, out.stderr
    assert not (tmp_path / "s").exists()
