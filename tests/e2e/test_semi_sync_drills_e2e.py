"""The drills under `ftctl up --sync diloco`, driven through `ftctl` as a user drives them: the
corrupt drill reads the pseudo-gradient check's verdict, the kill-heal drill sees the killed group
come back at a sync and heal the outer state, the hang drill sees the watchdog end a rank stuck
in an inner step (inner steps are its progress: no sync comes for H of them)."""

from __future__ import annotations

import pytest

from cluster import wait_for
from up_job import all_training, assert_each_sample_once, ftctl, ftctl_up, json_out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with ftctl_up(tmp_path_factory.mktemp("diloco-drills"), "--sync", "diloco", "--sync-every", "5", groups=2,
                  ranks_per_group=1) as job:
        yield job


def test_the_corrupt_drill_reads_the_pseudo_gradient_checks_verdict(job):
    wait_for(lambda: all_training(job.control), 240, "both groups training")
    drill = json_out(ftctl(job.state, "drill", "corrupt", "--group", "0", "--json"))
    assert drill["status"] == "done", drill
    r = drill["report"]
    assert (r["sdc_check"], r["detected_group"], r["verdict"], r["action"], r["checker_group"]) == (
        True, 0, "transient", "skipped", 1), r
    assert r["norms"]["0"] > 1000 * r["norms"]["1"] and r["fingerprints_equal"] is True, r
    assert job.control.sdc()["counts"] == {"transient": 1, "persistent": 0, "data": 0}


def test_the_kill_heal_drill_heals_the_killed_group_at_a_sync(job):
    wait_for(lambda: all_training(job.control), 240, "both groups training")
    drill = json_out(ftctl(job.state, "drill", "kill-heal", "--group", "1", "--json"))
    assert drill["status"] == "done" and drill["fingerprints_equal"] is True, drill
    r = drill["report"]
    assert r["rejoined_by"] == "agent" and r["heal_bytes"] > 0, r
    assert r["killed_at"] < r["rejoined_at"] <= r["heal_started_at"] <= r["healed_commit_at"]


def test_the_hang_drill_sees_the_watchdog_end_a_rank_stuck_in_an_inner_step(job):
    wait_for(lambda: all_training(job.control), 240, "both groups training")
    drill = json_out(ftctl(job.state, "drill", "hang", "--group", "0", "--mode", "stuck", "--json"))
    assert drill["status"] == "done" and drill["fingerprints_equal"] is True, drill
    r = drill["report"]
    assert (r["detected_by"], r["detected_group"], r["rejoined_by"]) == ("watchdog", 0, "agent"), r
    assert "in compute at step" in r["verdict"], r
    assert_each_sample_once(job.control)
