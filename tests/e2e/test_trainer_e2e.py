"""The trainer with real processes: torchrun groups, FSDP2, torchft, a real Lighthouse."""

from __future__ import annotations

import re
import statistics
import time

from cluster import committed_steps, coverage, fingerprints, job_args, kill_together, read_events, wait_for


def test_one_group_loss_goes_down_on_the_real_corpus(lighthouse, groups, tmp_path):
    g0 = groups(0, job_args(lighthouse, tmp_path, 1, 40, "--local-batch-size", "2")).start()
    assert g0.proc.wait(timeout=300) == 0, g0.output()
    losses = [e["loss"] for e in committed_steps(read_events(tmp_path / "events"), 0)]
    assert len(losses) == 40
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < first - 1.0, (first, last)
    start = next(e for e in read_events(tmp_path / "events") if e["type"] == "start")
    assert (start["config"], start["model"], start["dtype"]) == ("llama3_debugmodel_bytes", "llama3 debugmodel", "fp32")
    assert start["parameters"] > 1_000_000 and start["global_batch_size"] == 4
    exits = [e for e in read_events(tmp_path / "events") if e["type"] == "exit"]
    assert [e["reason"] for e in exits] == ["done", "done"]


def test_kill_a_group_survivor_keeps_training_and_relaunch_heals_bitwise(lighthouse, groups, tmp_path):
    events_dir = tmp_path / "events"
    args = job_args(lighthouse, tmp_path, 2, 10_000)
    g0, g1 = groups(0, args).start(), groups(1, args).start()

    def both_training():
        ev = read_events(events_dir)
        return all(len([e for e in committed_steps(ev, g) if e["participants"] == 2]) >= 5 for g in (0, 1))

    wait_for(both_training, 240, "both groups to commit 5 steps together")
    killed_at = g1.kill()

    def survivor_commits():
        return len(committed_steps(read_events(events_dir, 0), 0, since=killed_at)) >= 5

    wait_for(survivor_commits, 60, "group 0 to keep committing after group 1 was killed")
    after_kill = [e for e in read_events(events_dir, 0) if e["type"] == "step" and e["rank"] == 0
                  and e["ts"] >= killed_at]
    lost = [e for e in after_kill if not e["committed"]]
    assert len(lost) <= 1, f"survivor lost {len(lost)} steps: {lost}"
    assert any(e["participants"] == 1 for e in after_kill if e["committed"])

    relaunched_at = time.time()
    g1.start()

    def healed_and_training():
        ev = read_events(events_dir, 1)
        heals = [e for e in ev if e["type"] == "heal" and e["ts"] >= relaunched_at]
        return len(heals) == 2 and len(committed_steps(ev, 1, since=relaunched_at)) >= 5

    wait_for(healed_and_training, 240, "group 1 to heal from group 0 and commit 5 steps")
    g1.stop()
    g0.stop()

    events = read_events(events_dir)
    heals = [e for e in events if e["type"] == "heal" and e["ts"] >= relaunched_at]
    assert {e["source_group"] for e in heals} == {0}
    assert all(e["bytes"] > 0 for e in heals)
    first_healed_step = min(e["step"] for e in committed_steps(events, 1, since=relaunched_at))

    fp0, fp1 = fingerprints(events, 0), fingerprints(events, 1)
    shared = sorted(set(fp0) & set(fp1))
    before_kill = [k for k in shared if k[0] < first_healed_step]
    after_heal = [k for k in shared if k[0] >= first_healed_step]
    assert before_kill and len(after_heal) >= 8, (len(before_kill), len(after_heal))
    mismatched = [k for k in shared if fp0[k] != fp1[k]]
    assert not mismatched, f"fingerprints differ at (step, rank) {mismatched[:5]}"
    assert (first_healed_step, 0) in fp1, "no fingerprint at the rejoined group's first committed step"
    alone = [e for e in committed_steps(events, 0, since=killed_at) if e["participants"] == 1]
    assert alone and all(e["samples"] == e["global_batch"] == 4 for e in alone), \
        "alone, the survivor trains the whole global batch (two microbatches a rank)"
    planned, once, twice, skipped = coverage(events, tmp_path)
    assert (once, twice, skipped) == (planned, 0, 0) and planned >= 4 * 15, "every sample trained once"


def test_shrink_skips_exactly_the_share_of_a_missing_group(lighthouse, groups, tmp_path):
    """--batch-policy shrink: each group trains its own half; while group 1 is down its half of
    every step is skipped, and the coverage counts exactly those samples."""
    events_dir = tmp_path / "events"
    args = job_args(lighthouse, tmp_path, 2, 10_000, "--batch-policy", "shrink", "--ranks-per-group", "1",
                    "--local-batch-size", "2")
    g0, g1 = groups(0, args).start(), groups(1, args).start()
    wait_for(lambda: all(len([e for e in committed_steps(read_events(events_dir), g) if e["participants"] == 2]) >= 3
                         for g in (0, 1)), 240, "both groups to commit 3 steps together")
    killed_at = g1.kill()
    wait_for(lambda: len(committed_steps(read_events(events_dir, 0), 0, since=killed_at)) >= 4, 60,
             "group 0 to commit alone")
    g0.stop()
    events = read_events(events_dir)
    alone = [e for e in committed_steps(events, 0, since=killed_at) if e["participants"] == 1]
    assert alone and all(e["samples"] == e["step_samples"] == 2 for e in alone), "its own half, no more"
    steps = {e["step"]: e for g in (0, 1) for e in committed_steps(events, g) if e["consumed"]}
    halves = [step for step, e in steps.items() if e["step_samples"] == 2]  # the first group up was alone too
    planned, once, twice, skipped = coverage(events, tmp_path)
    assert (twice, skipped) == (0, 2 * len(halves)) and once == planned - skipped


def test_all_groups_restart_from_newest_complete_checkpoint(lighthouse, groups, tmp_path):
    events_dir, ckpt = tmp_path / "events", tmp_path / "ckpt"
    args = job_args(lighthouse, tmp_path, 2, 10_000, "--checkpoint-dir", str(ckpt),
                    "--checkpoint-every", "4", "--checkpoint-keep", "3")
    first = [groups(g, args).start() for g in (0, 1)]
    wait_for(lambda: len(list(ckpt.glob("step-*"))) >= 3, 300, "three checkpoints")
    kill_together(first)
    complete = sorted(ckpt.glob("step-*"))
    assert len(complete) == 3, "keep-last-3 was not honoured"
    newest, previous = complete[-1], complete[-2]
    shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    restarted_at = time.time()

    second = [groups(g, args).start() for g in (0, 1)]
    wait_for(lambda: all(committed_steps(read_events(events_dir, g), g, since=restarted_at) for g in (0, 1)),
             300, "both groups to commit after the restart")
    for g in second:
        g.stop()

    previous_step = int(previous.name.removeprefix("step-"))
    events = [e for e in read_events(events_dir) if e["ts"] >= restarted_at]
    starts = [e for e in events if e["type"] == "start"]
    assert {e["resumed_step"] for e in starts} == {previous_step}
    skipped = [e for e in events if e["type"] == "checkpoint" and e["action"] == "skipped"]
    assert skipped and all(e["step"] == int(newest.name.removeprefix("step-")) for e in skipped)
    assert any(re.search(r"warning: skipping incomplete checkpoint step-\d+", g.output()) for g in second)
    # The first group back trains on from the checkpoint; a later one may heal from it instead.
    assert min(committed_steps(events, g)[0]["step"] for g in (0, 1)) == previous_step + 1


def test_a_checkpoint_written_off_the_step_is_never_loaded_unless_its_write_finished(lighthouse, groups, tmp_path):
    """The step waits only for the copy; the folder is published after the background write, at the
    next step. A group killed with a save in flight leaves that folder unpublished; the next start
    removes it and resumes from the newest published one."""
    events_dir, ckpt = tmp_path / "events", tmp_path / "ckpt"
    args = job_args(lighthouse, tmp_path, 1, 10_000, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3",
                    "--step-sleep-s", "0.3")
    first = groups(0, args).start()
    wait_for(lambda: list(ckpt.glob("step-*")), 300, "a published checkpoint")
    in_flight = wait_for(lambda: list(ckpt.glob(".step-*.tmp-g0")), 60, "a save in flight", poll_s=0.01)
    kill_together([first])
    published = sorted(ckpt.glob("step-*"))
    flight_step = int(in_flight[0].name.split(".")[1].removeprefix("step-"))
    assert published and all(int(p.name.removeprefix("step-")) < flight_step for p in published)

    events = read_events(events_dir)
    saved = [e for e in events if e["type"] == "checkpoint" and e["action"] == "saved" and e["rank"] == 0]
    assert saved and all(0 < e["stall_s"] <= e["seconds"] for e in saved), saved
    stalls = {e["step"]: e["checkpoint_stall_s"] for e in committed_steps(events, 0)}
    assert all(stalls.get(e["step"] + 1, 0) > 0 for e in saved), "the step after a save shows no stall"

    restarted_at = time.time()
    second = groups(0, args).start()
    wait_for(lambda: committed_steps(read_events(events_dir, 0), 0, since=restarted_at), 300, "a commit after the restart")
    second.stop()
    start = next(e for e in read_events(events_dir) if e["type"] == "start" and e["ts"] >= restarted_at)
    assert start["resumed_step"] == int(published[-1].name.removeprefix("step-"))
    assert not in_flight[0].exists(), "the restart left the unfinished save's folder behind"


def test_max_norm_clips_every_group_by_the_same_global_norm(lighthouse, groups, tmp_path):
    """--max-norm clips by the norm of the averaged gradient: every group holds the same average,
    so every group reports the same norm, clips alike and stays bitwise equal; that norm is at
    most the mean of the groups' own norms (the check's), as an average's must be."""
    args = job_args(lighthouse, tmp_path, 2, 16, "--max-norm", "0.5")
    both = [groups(g, args).start() for g in (0, 1)]
    for g in both:
        assert g.proc.wait(timeout=300) == 0, g.output()
    events = read_events(tmp_path / "events")
    by_step = [{e["step"]: e for e in committed_steps(events, g) if e["participants"] == 2} for g in (0, 1)]
    shared = sorted(set(by_step[0]) & set(by_step[1]))
    assert len(shared) >= 4, shared  # the first steps may find one group still joining or healing
    for step in shared:
        a, b = by_step[0][step], by_step[1][step]
        assert a["clip_norm"] == b["clip_norm"] is not None, (step, a["clip_norm"], b["clip_norm"])
        assert a["clip_norm"] <= (a["grad_norm"] + b["grad_norm"]) / 2 * (1 + 1e-6), (step, a, b)
    assert any(by_step[0][s]["clip_norm"] > 0.5 for s in shared), "no step was clipped: raise the test's norm"
    fp0, fp1 = fingerprints(events, 0), fingerprints(events, 1)
    common = sorted(set(fp0) & set(fp1))
    assert common and all(fp0[k] == fp1[k] for k in common)
