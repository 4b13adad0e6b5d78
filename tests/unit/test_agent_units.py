"""The agent's pieces that need no training processes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from protocol.layout import GroupLayout
from protocol.agent import PROBE_PATH, STATUS_PATH, AgentStatus, ProbeResult, command_path
from protocol.files import read_model, write_model
from protocol.injection import INJECT_PATH
from protocol.torchrun import free_port
from service.agent.app import create_app
from service.agent.config import AgentSettings
from service.agent.pidfile import PidRecord, forget_pid, reap_pidfile, record_pid
from service.agent.spare import WarmSpare
from service.agent.supervisor import GroupCommand
from service.proctree import descends_from, kill_tree, process_tree, wait_gone


def spare(tmp_path: Path) -> WarmSpare:
    return WarmSpare(GroupCommand(1, 2, [], None, tmp_path / "group1.log"), tmp_path, respawn_delay_s=0)


def test_a_new_spare_keeps_the_files_of_the_spare_promoted_before_it(tmp_path):
    s = spare(tmp_path)
    for generation in (1, 2, 3):
        for suffix in ("", ".ready-r0", ".ready-r1"):
            (tmp_path / (GroupLayout(1).promotion(generation) + suffix)).touch()
    (tmp_path / GroupLayout(0).promotion(1)).touch()
    s.generation = 3
    s.clean(keep_from=s.generation - 1)  # what launch() does for generation 3
    left = sorted(p.name for p in tmp_path.glob("g*.promote.*"))
    assert left == ["g0.promote.1", "g1.promote.2", "g1.promote.2.ready-r0", "g1.promote.2.ready-r1",
                    "g1.promote.3", "g1.promote.3.ready-r0", "g1.promote.3.ready-r1"]


def test_readiness_needs_every_rank(tmp_path):
    s = spare(tmp_path)
    s.generation = 1
    assert [p.name for p in s._ready_paths()] == ["g1.promote.1.ready-r0", "g1.promote.1.ready-r1"]
    assert s.state() is None and s.promote() is None  # no process: nothing to promote


def test_a_killed_process_nobody_reaped_yet_counts_as_gone():
    """A zombie holds nothing but its pid: a fail-over must not wait for its parent to reap it."""
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        zombie.send_signal(signal.SIGKILL)
        assert wait_gone([zombie.pid], 10) == []
        assert psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE  # still unreaped: gone all the same
        assert wait_gone([alive.pid, zombie.pid], 0.3) == [alive.pid]
    finally:
        for proc in (zombie, alive):
            proc.kill()
            proc.wait()


def test_a_process_belongs_to_a_tree_when_a_walk_up_from_it_meets_the_root():
    """What the watchdog asks ten times a second of each beacon's pid, found by walking up the
    pid's parents instead of listing the root's tree (a read of every process on the node)."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                              start_new_session=True)  # as torchrun starts its workers: a session of their own
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        while len(tree := process_tree(parent.pid)) < 2:
            pass
        grandchild = tree[1].pid
        assert descends_from(parent.pid, parent.pid) and descends_from(grandchild, parent.pid)
        assert not descends_from(stranger.pid, parent.pid) and not descends_from(parent.pid, grandchild)
        assert not descends_from(2**22 + 1, parent.pid)  # above any pid_max: no such process
    finally:
        kill_tree(parent.pid)
        parent.wait()
        stranger.kill()
        stranger.wait()


def test_the_agents_api_answers_in_the_protocols_models_and_counts_with_counters(tmp_path):
    settings = AgentSettings(group=1, groups=2, token="agent-token-0123456789abcdef", autostart=False, state_dir=tmp_path,
                             allowed_hosts=["testserver"])
    with TestClient(create_app(settings)) as api:
        status = AgentStatus.model_validate(api.get(STATUS_PATH).json())
        assert (status.group, status.state, status.pids, status.spare) == (1, "down", [], None)
        assert api.post(command_path("kill")).status_code == 401
        auth = {"Authorization": "Bearer agent-token-0123456789abcdef"}
        kill = api.post(command_path("kill"), headers=auth)
        assert kill.status_code == 409 and kill.json() == {"detail": "group 1 is not running"}
        rotating = {"kind": "slow", "delay_ms": 300, "every": 3, "offset": 3}
        wrong = api.post(INJECT_PATH, headers=auth, json=rotating)
        assert wrong.status_code == 422 and "offset 3 must be below every 3" in wrong.text
        no_rank = api.post(INJECT_PATH, headers=auth, json={**rotating, "offset": 2})
        assert no_rank.status_code == 409 and "group 1 has no rank up" in no_rank.json()["detail"]
        with socket.create_server(("127.0.0.1", 0)) as listening:
            closed = free_port()  # nothing listens there: refused, so the host answered
            peers = {0: f"http://127.0.0.1:{listening.getsockname()[1]}", 2: f"http://127.0.0.1:{closed}"}
            assert api.post(PROBE_PATH, json={"peers": peers}).status_code == 401
            probed = api.post(PROBE_PATH, headers=auth, json={"peers": peers, "timeout_s": 2})
        assert probed.status_code == 200 and ProbeResult.model_validate(probed.json()) == ProbeResult(
            group=1, reached={0: True, 2: True})
        assert api.post(PROBE_PATH, headers=auth, json={"peers": {"x": "not a url"}}).status_code == 422
        families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
    for name in ("ftctl_agent_events_dropped", "ftctl_agent_events_refused", "ftctl_agent_events_invalid",
                 "ftctl_agent_events_forwarded", "ftctl_agent_group_starts"):
        assert families[name].type == "counter" and families[name].samples[0].name == f"{name}_total"
        assert families[name].samples[0].value == 0
    assert families["ftctl_agent_group_running"].type == "gauge"


def test_a_pid_record_kills_only_the_very_process_it_names(tmp_path):
    """A dead agent's record kills its group's orphan; a reused pid (another start time) or another
    group's record kills nothing, and every record is gone once read."""
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        path = tmp_path / "group1.pid"
        record_pid(path, stranger.pid, group=1)
        write_model(path, read_model(path, PidRecord).model_copy(update={"started": 12345.0}))  # as after pid reuse
        assert reap_pidfile(path, group=1) == [] and stranger.poll() is None and not path.exists()
        record_pid(path, stranger.pid, group=2)
        assert reap_pidfile(path, group=1) == [] and stranger.poll() is None
        record_pid(path, orphan.pid, group=1)
        assert reap_pidfile(path, group=1) == [orphan.pid]
        assert orphan.wait(10) == -signal.SIGKILL and not path.exists()
        record_pid(path, stranger.pid, group=1)
        forget_pid(path, orphan.pid)
        assert path.exists(), "the record of another process is kept"
        forget_pid(path, stranger.pid)
        assert not path.exists()
    finally:
        for proc in (orphan, stranger):
            proc.kill()
            proc.wait()
