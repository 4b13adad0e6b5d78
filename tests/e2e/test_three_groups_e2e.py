"""Three groups: whichever one dies, the other two commit again long before the collective
timeout; a node that freezes with its agent on it is shown lost and the others train on; a
Lighthouse away past the trainers' quorum timeout stops the groups cleanly, once,
and their agents bring them back when it answers again; and a slowed group is named a
straggler, alone; a corrupted gradient is caught, rerun by another group and shown; a group
killed or stopped from outside comes back by itself, and one that keeps going down is held down
as crash-looping, then tried again."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import httpx
import psutil
import pytest

from bench.browser import chromium, quietly
from cluster import wait_for
from service.proctree import process_tree
from up_job import (agent_auth, all_training, assert_recovery_adds_up, ftctl, ftctl_up, groups, json_out,
                    metric)

COLLECTIVE_TIMEOUT_S = 10.0  # the trainers' --timeout-s default
QUORUM_TIMEOUT_S = 4.0
CRASH_LOOP_COOLDOWN_S = 8.0
STRAGGLER_FACTOR = 1.5
"""Three single-rank groups on two cores differ by up to ~1.25× in compute by themselves (one
shares its core more): the default 1.15 flags that, rightly, and would blur what the drill shows."""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with ftctl_up(tmp_path_factory.mktemp("three"), "--straggler-factor", str(STRAGGLER_FACTOR),
                  "--crash-loop-cooldown-s", str(CRASH_LOOP_COOLDOWN_S),
                  f"--trainer-arg=--quorum-timeout-s={QUORUM_TIMEOUT_S:g}", groups=3, ranks_per_group=1) as job:
        yield job


@pytest.mark.parametrize("group", [0, 1, 2])
def test_the_survivors_of_any_groups_kill_commit_within_half_the_collective_timeout(job, group):
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    drill = json_out(ftctl(job.state, "drill", "kill-heal", "--group", str(group), "--json"))
    assert drill["status"] == "done" and drill["fingerprints_equal"] is True, drill
    r = drill["report"]
    assert r["survivors"] == sorted({0, 1, 2} - {group})
    assert r["survivors_resume_s"] < COLLECTIVE_TIMEOUT_S / 2, r
    heal = job.control.events(group=group, type="heal", since=r["killed_at"])[-1]
    assert sorted(heal["sources"]) == r["survivors"], "the heal is striped over both live peers"
    assert_recovery_adds_up(r)


def test_a_group_frozen_with_its_agent_is_lost_and_the_others_train_on(job):
    """SIGSTOP of group 1's agent and every process under it, as a node that hangs whole: no
    process event comes, the agent answers nothing, the heartbeat stops."""
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    root = psutil.Process(job.control.agent_status(1)["pid"])  # forked by the zygote, or torchrun
    agent = next(p for p in root.parents() if "service.agent" in " ".join(p.cmdline()))
    frozen = [agent, *process_tree(agent.pid)[1:]]  # the agent first: it cannot act on what it sees stop
    at = time.time()
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    try:
        lost = wait_for(lambda: groups(job.control)[1]["down_reason"] == "lost" and groups(job.control)[1], 30,
                        "group 1 shown lost")
        assert lost["since"] - at < 5, "lost should be declared within about the heartbeat timeout + lost_after_s"
        print(f"group 1 shown lost {lost['since'] - at:.1f} s after it froze")
        metrics = job.api.get("/metrics").text
        assert 'ftctl_group_up{group="1"} 0.0' in metrics
        assert 'ftctl_group_exits_total{group="1",reason="lost"} 1.0' in metrics
        step = {g: groups(job.control)[g]["step"] for g in (0, 2)}
        wait_for(lambda: all(groups(job.control)[g]["step"] > step[g] for g in (0, 2)), 30, "groups 0 and 2 to train on")
    finally:
        for p in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)
    wait_for(lambda: all_training(job.control), 240, "group 1 back once its node thaws")


def test_a_lighthouse_away_past_the_quorum_timeout_stops_the_groups_once_and_they_come_back(job):
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    down_s = QUORUM_TIMEOUT_S + 6
    drill = json_out(ftctl(job.state, "drill", "lighthouse", "--down", f"{down_s:g}", "--json"))
    assert drill["status"] == "done", drill
    r = drill["report"]
    assert r["away_s"] >= down_s
    stopped = job.control.events(type="exit", since=r["killed_at"])
    assert sorted(e["group"] for e in stopped) == [0, 1, 2], stopped
    assert {e["reason"] for e in stopped} == {"lighthouse-away"}, stopped
    assert all("--quorum-timeout-s" in e["error"] for e in stopped)
    starts = job.control.events(type="process", since=r["killed_at"])
    started = [e for e in starts if e["action"] == "started"]
    assert sorted(e["group"] for e in started) == [0, 1, 2], "one restart per group, none while it was away"
    assert all(e["ts"] >= r["back_at"] - 1.0 for e in started), "an agent restarted its group into a crash loop"
    assert r["fingerprints_equal"] is True


@pytest.mark.browser
def test_a_straggler_drill_names_the_slow_group_leaves_the_others_alone_and_shows_it(job):
    """Group 2 sleeps 300 ms before every forward (about 2.5× its compute here): flagged, kept
    under the job's policy (flag), shown on its card in Chromium, cleared once it is fast again."""
    from selenium.webdriver.common.by import By

    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    starts = {g: v["restarts"] for g, v in groups(job.control).items()}
    drill = job.control.start_drill({"kind": "straggler", "group": 2, "delay_ms": 300, "duration_s": 15,
                                     "baseline_s": 5, "after_s": 5})
    flagged = wait_for(lambda: groups(job.control).get(2, {}).get("straggler"), 40, "group 2 flagged as a straggler")
    assert flagged["slowdown"] > STRAGGLER_FACTOR and flagged["policy_action"] == "flag"
    view = job.control.stragglers()
    assert view["flagged"] == 2 and view["pattern"] == "persistent" and view["policy"] == "flag"
    assert 'ftctl_straggler{group="2"} 1.0' in job.api.get("/metrics").text
    with chromium() as driver:
        driver.get(str(job.api.base_url))
        badge = lambda: driver.find_element(By.CSS_SELECTOR, "#group-2 .badge.straggler")  # noqa: E731
        wait_for(quietly(lambda: badge().is_displayed() and badge().text.startswith("straggler ×")), 20,
                 "the straggler badge on group 2's card")
        wait_for(quietly(lambda: "straggler flagged" in driver.find_element(By.ID, "events").text), 20,
                 "the flag in the page's timeline")
        assert not driver.find_element(By.CSS_SELECTOR, "#group-0 .badge.straggler").is_displayed()
    report = wait_for(lambda: (d := job.control.drill(drill["id"]))["status"] != "running" and d, 90, "the drill to end")
    assert report["status"] == "done", report
    r = report["report"]
    assert (r["detected_group"], r["others_flagged"], r["action"]) == (2, [], "flagged"), r
    assert r["flagged_before"] is None and 0 < r["detect_s"] < 15 and r["slowdown"] > STRAGGLER_FACTOR
    assert r["relative"] < 1
    assert r["throughput"]["during"] < r["throughput"]["before"], r["throughput"]
    assert r["cleared_at"] is not None, "cleared once the delay ended"
    assert {g: v["restarts"] for g, v in groups(job.control).items()} == starts, "nobody was restarted"
    assert groups(job.control)[2]["straggler"] is None
    assert ended_on_a_lost_peer(job, drill["created"]) == [], "a slow group is never taken for a lost one"


def test_under_the_evict_policy_a_straggler_that_costs_more_than_its_share_is_evicted_for_good(job):
    """The same delay under the drill's evict policy: slowing three groups by about 2× costs more
    than losing one of them (1/3), so the group is ended as evicted, and its agent, which restarts
    killed groups by itself here, leaves it down; a rejoin brings it back."""
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    d = json_out(ftctl(job.state, "drill", "straggler", "--group", "1", "--delay-ms", "300", "--duration", "15",
                       "--policy", "evict", "--json"))
    r = d["report"]
    assert (d["status"], r["detected_group"], r["action"], r["ended"]) == ("done", 1, "evicted", None), r
    assert r["keep_cost"] > r["evict_cost"] == pytest.approx(1 / 3) and "evicting pays" in r["detail"]
    assert r["others_flagged"] == [] and r["throughput"]["after"] > 0
    assert (groups(job.control)[1]["state"], groups(job.control)[1]["down_reason"]) == ("down", "evicted")
    assert job.control.stragglers()["policy"] == "flag", "the job's own policy is back"
    job.control.rejoin(1)
    wait_for(lambda: all_training(job.control), 240, "group 1 back after its rejoin")


@pytest.mark.browser
def test_with_three_groups_a_corruption_is_rerun_by_another_group_and_shown_on_the_page(job):
    """Group 2's gradient ×1e4 once: the check compares it with the two others' median, a passing
    group reruns its batch, every group skips the step; the page shows the incident on group 2's
    card and in its timeline."""
    from selenium.webdriver.common.by import By

    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    drill = job.control.start_drill({"kind": "corrupt", "group": 2, "baseline_s": 3})
    report = wait_for(lambda: (d := job.control.drill(drill["id"]))["status"] != "running" and d, 120,
                      "the corruption drill to end")
    assert report["status"] == "done" and report["fingerprints_equal"] is True, report
    r = report["report"]
    assert (r["detected_group"], r["verdict"], r["action"]) == (2, "transient", "skipped"), r
    assert sorted(r["norms"]) == ["0", "1", "2"] and r["checker_group"] in (0, 1)
    with chromium() as driver:
        driver.get(str(job.api.base_url))
        badge = lambda: driver.find_element(By.CSS_SELECTOR, "#group-2 .badge.sdc")  # noqa: E731
        wait_for(quietly(lambda: badge().is_displayed() and badge().text == "SDC transient"), 20,
                 "the SDC badge on group 2's card")
        wait_for(quietly(lambda: "gradient check at step" in driver.find_element(By.ID, "events").text), 20,
                 "the incident in the page's timeline")
        other = driver.find_element(By.CSS_SELECTOR, "#group-0 .badge.sdc")  # a real spike of its own may show
        assert not other.is_displayed() or f"step {r['step']}:" not in other.get_attribute("title")


ROTATING_S = 12.0
"""About 20 steps here (0.3 s of work + the 300 ms sleep): two of the detector's 10-step windows."""


def test_slowness_that_rotates_from_group_to_group_is_never_flagged(job):
    """Group g sleeps 300 ms before the forward of each step whose number is g modulo 3: some
    group is slow at every step, none step after step. The detector calls it rotating (data
    imbalance, as most stragglers are) and flags nobody. (Turns by the clock instead, half a
    second each, slowed one group step after step once the steps took as long as a round of
    turns: on a slower machine it was flagged.)"""
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    agents = job.connection()["agents"]
    started = time.time()
    for g in range(3):
        injected = httpx.post(f"{agents[str(g)]}/inject", headers=agent_auth(g), timeout=30,
                              json={"kind": "slow", "delay_ms": 300, "seconds": ROTATING_S, "every": 3, "offset": g})
        assert injected.status_code == 200, injected.text
    patterns, flagged = set(), set()
    end = time.time() + ROTATING_S
    while time.time() < end:
        view = job.control.stragglers()
        patterns.add(view["pattern"])
        if view["flagged"] is not None:
            flagged.add(view["flagged"])
        time.sleep(0.1)
    assert flagged == set(), f"rotating slowness flagged group(s) {flagged}"
    assert "rotating" in patterns and "persistent" not in patterns, patterns
    assert ended_on_a_lost_peer(job, started) == [], "slow groups are never taken for lost ones"


def ended_on_a_lost_peer(job, since: float) -> list[dict]:
    """Steps whose cross-group collective the collective watch ended since ``since``."""
    return [e for g in range(3) for e in job.control.events(group=g, type="commit_failed", since=since)
            if "lost a peer" in (e["error"] or "")]


def process_events(job, group: int, since: float, action: str) -> list[dict]:
    return [e for e in job.control.events(group=group, type="process", since=since) if e["action"] == action]


def signal_group(job, group: int, sig: int) -> float:
    """``sig`` to every process of the group's current start, from outside its agent (an OOM
    killer, a node's own watchdog, an operator's stray ``kill``); when it was sent."""
    pids = wait_for(lambda: job.control.agent_status(group)["pids"], 60, f"group {group}'s processes")
    at = time.time()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return at


def trains_again(job, group: int, since: float) -> float:
    """When the group committed a step after ``since`` (its healed commit)."""
    return wait_for(lambda: next((e["ts"] for e in job.control.events(group=group, type="step", since=since)
                                  if e["committed"] and e["rank"] == 0), None), 120, f"group {group} to train again")


@pytest.mark.parametrize("group, sig, exit_kind", [(2, signal.SIGKILL, "crashed"), (0, signal.SIGSTOP, "hung")])
def test_a_group_killed_or_stopped_from_outside_comes_back_by_itself(job, group, sig, exit_kind):
    """Nobody calls rejoin: the agent sees the exit (a SIGSTOP: its watchdog ends the silent
    group) and starts the group again at once, which heals from a live peer."""
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    at = signal_group(job, group, sig)
    [exited] = wait_for(lambda: process_events(job, group, at, exit_kind), 30, f"group {group} {exit_kind}")
    [started] = wait_for(lambda: process_events(job, group, at, "started"), 30, f"group {group} started again")
    assert f"restarted by its agent after {exit_kind}" in started["detail"], started
    assert started["ts"] - exited["ts"] < 2.0, "the first restart is at once (the second after 1 s)"
    trained = trains_again(job, group, started["ts"])
    print(f"{signal.Signals(sig).name}: {exit_kind} {exited['ts'] - at:.2f} s after the signal, started again "
          f"{started['ts'] - at:.2f} s, trained again {trained - at:.2f} s")
    assert job.control.events(group=group, type="heal", since=started["ts"]), "it healed from a live peer"


def test_a_drained_group_commits_its_step_leaves_and_stays_down_until_rejoined(job):
    """``ftctl drain``: the group finishes and commits its step and leaves; no survivor step
    fails its commit; nothing brings it back by itself (not its agent); a rejoin does."""
    group, survivors = 0, (1, 2)
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    at = time.time()
    result = ftctl(job.state, "drain", str(group), "--reason", "firmware update")
    assert result.returncode == 0 and f"group {group}: drain done; now down (drained)" in result.stdout, result
    [drained] = process_events(job, group, at, "drained")
    assert drained["detail"] == "firmware update" and drained["returncode"] == 0, drained
    step = {g: groups(job.control)[g]["step"] for g in survivors}
    wait_for(lambda: all(groups(job.control)[g]["step"] >= step[g] + 10 for g in survivors), 60, "the survivors' steps")
    steps = [e for g in survivors for e in job.control.events(group=g, type="step", since=at, limit=1000)
             if e["rank"] == 0]
    assert [e for e in steps if not e["committed"]] == [], "a survivor step failed its commit during the drain"
    times = sorted(e["step_s"] for e in steps)
    print(f"drain: survivors' steps after it: median {times[len(times) // 2]:.2f} s, longest {times[-1]:.2f} s")
    assert process_events(job, group, at, "started") == [], "a drained group came back by itself"
    view = groups(job.control)[group]
    assert (view["state"], view["down_reason"], view["down_detail"]) == ("down", "drained", "firmware update"), view
    job.control.rejoin(group)
    [started] = wait_for(lambda: process_events(job, group, at, "started"), 30, "the rejoin")
    trains_again(job, group, started["ts"])


def test_the_drain_drill_loses_no_survivor_step_and_ends_in_equal_state(job):
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    drill = json_out(ftctl(job.state, "drill", "drain", "--group", "2", "--reason", "kernel upgrade", "--json"))
    assert drill["status"] == "done" and drill["fingerprints_equal"] is True, drill
    r = drill["report"]
    assert (r["reason"], r["rejoined_by"], r["survivors"], r["survivors_steps_lost"]) == (
        "kernel upgrade", "drill", [0, 1], 0), r
    assert r["killed_at"] < r["drained_at"] <= r["survivors_first_commit_at"] < r["rejoined_at"] < r["healed_commit_at"]
    assert_recovery_adds_up(r)


def test_a_group_that_keeps_going_down_is_held_as_crash_looping_then_tried_again(job):
    """Kill it from outside as soon as it runs, again and again: the restarts back off (at once,
    1, 2, 4 s) and the fifth unplanned exit within the window holds it down (crash-loop, an
    event, the exits metric the alert reads) for the cool-down; then it is tried again."""
    group = 1
    wait_for(lambda: all_training(job.control), 240, "all three groups training")
    began = time.time()
    for _ in range(5):  # fewer when earlier tests left recent failures of this group
        if process_events(job, group, began, "crash-loop"):
            break
        wait_for(lambda: job.control.agent_status(group)["state"] == "running", 60, f"group {group} running")
        signal_group(job, group, signal.SIGKILL)
        time.sleep(0.5)  # the agent sees the exit and plans the next start
    [held] = wait_for(lambda: process_events(job, group, began, "crash-loop"), 60, "the crash-loop hold")
    assert held["detail"].startswith("5 unplanned exits within 600 s, the last crashed"), held
    view = groups(job.control)[group]
    assert (view["state"], view["down_reason"]) == ("down", "crash-loop"), view
    assert job.control.agent_status(group)["restart_at"] == pytest.approx(held["ts"] + CRASH_LOOP_COOLDOWN_S, abs=1)
    assert metric(job.api, "ftctl_group_exits_total", group=str(group), reason="crash-loop") >= 1
    backoffs = [float(m[1]) for e in process_events(job, group, began, "started")
                if (m := re.search(r", after ([0-9.]+) s$", e["detail"]))]
    assert backoffs and all(b == 2 * a for a, b in zip(backoffs, backoffs[1:])), f"the restarts back off: {backoffs}"
    [retried] = wait_for(lambda: process_events(job, group, held["ts"], "started"), 60, "the retry after the cool-down")
    assert retried["ts"] - held["ts"] >= CRASH_LOOP_COOLDOWN_S - 0.5
    assert retried["detail"].endswith(f"after a crash-loop hold of {CRASH_LOOP_COOLDOWN_S:g} s"), retried
    trains_again(job, group, retried["ts"])
