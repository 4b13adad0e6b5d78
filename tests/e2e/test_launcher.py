"""`ftctl up` among other processes: one job per state folder, health answers from its own
servers only, and nothing it started outlives it, whether it is stopped, hung up on or killed."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

from cluster import REPO, stored, wait_for
from processes import Owner
from protocol.torchrun import free_port
from service.proctree import process_tree, wait_gone
from up_job import TOKEN, all_training, ftctl_up


def up(owner: Owner, state, port: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "up", "--groups", "1", "--ranks-per-group", "1",
                           "--port", str(port), "--lighthouse-port", str(free_port()), "--state-dir", str(state)],
                          cwd=REPO, env=owner.env(FTCTL_TOKEN=TOKEN), capture_output=True, text=True, timeout=120)


def test_one_job_per_folder_its_ports_its_own_and_a_hang_up_stops_it(tmp_path):
    (tmp_path / "a").mkdir()
    with ftctl_up(tmp_path / "a", groups=1, ranks_per_group=1) as job, Owner() as owner:
        everything = [p.pid for p in process_tree(job.proc.pid)]
        port = job.api.base_url.port
        second = up(owner, job.state, free_port())
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"another ftctl up (pid {job.proc.pid}) runs on {job.state}/" in second.stderr
        third = up(owner, tmp_path / "c" / "state", port)
        assert third.returncode == 1 and third.stderr.startswith("ftctl: error: "), third.stdout + third.stderr
        assert "answered by process" in third.stderr or "controlplane exited" in third.stderr, third.stderr
        assert not owner.end(), "the refused jobs left processes behind"
        assert job.api.get("/healthz").json()["server_pid"] in everything, "the first job's control plane still serves"
        job.proc.send_signal(signal.SIGHUP)  # the terminal closed
        assert job.proc.wait(120) == 0, job.log.read_text()[-3000:]
        assert not wait_gone(everything, 10), "processes left behind after SIGHUP"
    assert TOKEN not in job.log.read_text(), "the token goes to a terminal, never into a log"


def test_a_killed_ftctl_takes_what_it_started_with_it(tmp_path):
    with ftctl_up(tmp_path, groups=1, ranks_per_group=1) as job:
        wait_for(lambda: len(process_tree(job.proc.pid)) >= 6, 120, "the group's ranks to start")
        children = [p.pid for p in process_tree(job.proc.pid) if p.pid != job.proc.pid]
        os.kill(job.proc.pid, signal.SIGKILL)  # no handler runs: only the kernel can tell the children
        job.proc.wait()
        assert not wait_gone(children, 60), "children outlived a SIGKILLed ftctl"
        assert lock_is_free(job.state), "the dead job's lock on its state folder outlived it"


def lock_is_free(state) -> bool:
    fd = os.open(state / "ftctl-up.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_ctrl_c_stops_everything(tmp_path):
    with ftctl_up(tmp_path) as job:
        wait_for(lambda: all_training(job.control), 240, "both groups training")
        everything = [p.pid for p in process_tree(job.proc.pid)]
        assert len(everything) >= 10  # ftctl, lighthouse x2, control plane, 2 agents, torchruns, ranks
        job.proc.send_signal(signal.SIGINT)
        assert job.proc.wait(120) == 0, job.log.read_text()[-3000:]
        assert not wait_gone(everything, 10), "processes left behind after Ctrl-C"
        assert "no process left behind" in job.log.read_text()
    drained = [e for e in stored(job.state / "control.db", "process") if e["action"] == "drained"]
    assert sorted((e["group"], e["detail"]) for e in drained) == [(g, "its agent was stopped") for g in (0, 1)], \
        "a SIGTERM to an agent drains its group"
