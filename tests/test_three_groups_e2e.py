"""Three groups: whichever one dies, the other two commit again long before the collective
timeout; a node that freezes with its agent on it is shown lost and the others train on; and a
Lighthouse away past the trainers' quorum timeout stops the groups cleanly, once,
and their agents bring them back when it answers again."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from cluster import wait_for
from service.proctree import process_tree
from up_job import all_training, ftctl, ftctl_up, groups, json_out

COLLECTIVE_TIMEOUT_S = 10.0  # the trainers' --timeout-s default
QUORUM_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with ftctl_up(tmp_path_factory.mktemp("three"), "--auto-rejoin-delay", "0",
                  f"--trainer-arg=--quorum-timeout-s={QUORUM_TIMEOUT_S:g}", groups=3, ranks_per_group=1) as job:
        yield job


@pytest.mark.parametrize("group", [0, 1, 2])
def test_the_survivors_of_any_groups_kill_commit_within_half_the_collective_timeout(job, group):
    wait_for(lambda: all_training(job.api), 240, "all three groups training")
    drill = json_out(ftctl(job.state, "drill", "kill-heal", "--group", str(group), "--json"))
    assert drill["status"] == "done" and drill["fingerprints_equal"] is True, drill
    r = drill["report"]
    assert r["survivors"] == sorted({0, 1, 2} - {group})
    assert r["survivors_resume_s"] < COLLECTIVE_TIMEOUT_S / 2, r


def test_a_group_frozen_with_its_agent_is_lost_and_the_others_train_on(job):
    """SIGSTOP of group 1's agent and every process under it, as a node that hangs whole: no
    process event comes, the agent answers nothing, the heartbeat stops."""
    wait_for(lambda: all_training(job.api), 240, "all three groups training")
    torchrun = job.api.get("/api/v1/groups/1/agent").json()["pid"]
    frozen = [psutil.Process(torchrun).parent(), *process_tree(torchrun)]
    at = time.time()
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    try:
        lost = wait_for(lambda: groups(job.api)[1]["down_reason"] == "lost" and groups(job.api)[1], 30,
                        "group 1 shown lost")
        assert lost["since"] - at < 8, "lost should be declared within about the heartbeat timeout + lost_after_s"
        metrics = job.api.get("/metrics").text
        assert 'ftctl_group_up{group="1"} 0.0' in metrics
        assert 'ftctl_group_exits_total{group="1",reason="lost"} 1.0' in metrics
        step = {g: groups(job.api)[g]["step"] for g in (0, 2)}
        wait_for(lambda: all(groups(job.api)[g]["step"] > step[g] for g in (0, 2)), 30, "groups 0 and 2 to train on")
    finally:
        for p in frozen:
            p.send_signal(signal.SIGCONT)
    wait_for(lambda: all_training(job.api), 240, "group 1 back once its node thaws")


def test_a_lighthouse_away_past_the_quorum_timeout_stops_the_groups_once_and_they_come_back(job):
    wait_for(lambda: all_training(job.api), 240, "all three groups training")
    down_s = QUORUM_TIMEOUT_S + 6
    drill = json_out(ftctl(job.state, "drill", "lighthouse", "--down", f"{down_s:g}", "--json"))
    assert drill["status"] == "done", drill
    r = drill["report"]
    assert r["away_s"] >= down_s
    stopped = job.api.get("/api/v1/events", params={"type": "exit", "since": r["killed_at"]}).json()["events"]
    assert sorted(e["group"] for e in stopped) == [0, 1, 2], stopped
    assert {e["reason"] for e in stopped} == {"lighthouse-away"}, stopped
    assert all("--quorum-timeout-s" in e["error"] for e in stopped)
    starts = job.api.get("/api/v1/events", params={"type": "process", "since": r["killed_at"]}).json()["events"]
    started = [e for e in starts if e["action"] == "started"]
    assert sorted(e["group"] for e in started) == [0, 1, 2], "one restart per group, none while it was away"
    assert all(e["ts"] >= r["back_at"] - 1.0 for e in started), "an agent restarted its group into a crash loop"
    assert r["fingerprints_equal"] is True
