"""--sync diloco|localsgd with real processes: torchrun groups, FSDP2, torchft's DiLoCo, a real Lighthouse."""

from __future__ import annotations

import time
from pathlib import Path

from cluster import committed_steps, coverage, fingerprints, job_args, kill_together, read_events, wait_for
from protocol.files import write_model
from protocol.injection import Injection
from protocol.layout import GroupLayout


def syncs(events: list[dict], group: int, since: float = 0.0) -> list[dict]:
    return [e for e in events if e["type"] == "sync" and e["group"] == group and e["rank"] == 0 and e["ts"] >= since]


def synced_together(events_dir: Path, n: int, since: float = 0.0) -> bool:
    """Both groups committed ``n`` syncs of windows both trained, since ``since``."""
    ev = read_events(events_dir)
    return all(len([s for s in syncs(ev, g, since) if s["committed"] and s["members"] == 2]) >= n for g in (0, 1))


def test_diloco_groups_sync_survive_a_kill_between_syncs_and_a_rejoined_group_equals_the_others(
        lighthouse, groups, tmp_path):
    events_dir = tmp_path / "events"
    args = job_args(lighthouse, tmp_path, 2, 10_000, "--sync", "diloco", "--sync-every", "5")
    g0, g1 = groups(0, args).start(), groups(1, args).start()
    wait_for(lambda: synced_together(events_dir, 2), 240, "both groups to commit 2 syncs together")
    killed_at = g1.kill()
    wait_for(lambda: len([s for s in syncs(read_events(events_dir, 0), 0, killed_at) if s["committed"]]) >= 2, 90,
             "group 0 to commit 2 syncs alone")
    after_kill = syncs(read_events(events_dir, 0), 0, killed_at)
    failed = [s for s in after_kill if not s["committed"]]
    assert len(failed) <= 1, f"the survivor lost {len(failed)} syncs: {failed}"
    assert all(s["participants"] == 1 for s in after_kill if s["committed"])

    relaunched_at = time.time()
    g1.start()
    wait_for(lambda: synced_together(events_dir, 2, relaunched_at), 240, "group 1 to rejoin and commit 2 syncs with group 0")
    g1.stop()
    g0.stop()

    events = read_events(events_dir)
    joined = [s for s in syncs(events, 1, relaunched_at) if s["joined"]]
    assert joined and joined[0]["healed"] and joined[0]["committed"], joined
    rejoined_at = joined[0]["step"]
    fp0, fp1 = fingerprints(events, 0), fingerprints(events, 1)
    shared = sorted(set(fp0) & set(fp1))
    assert any(step >= rejoined_at for step, _ in shared) and any(step < rejoined_at for step, _ in shared)
    mismatched = [k for k in shared if fp0[k] != fp1[k]]
    assert not mismatched, f"the last synced state differs at (step, rank) {mismatched[:5]}"
    inner = [e for e in events if e["type"] == "step" and e["rank"] == 0]
    assert inner and all(e["commit_s"] == 0.0 for e in inner), "inner steps wait on no other group"
    assert all(s["bytes"] > 0 and s["seconds"] >= 0 for s in syncs(events, 0) if not s["joined"])
    planned, once, twice, skipped = coverage(events, tmp_path)
    assert (once, twice, skipped) == (planned, 0, 0) and planned >= 4 * 20, "every sample trained once"


def test_localsgd_shrink_a_kill_between_syncs_costs_the_survivor_no_step(lighthouse, groups, tmp_path):
    """--batch-policy shrink: the survivor's window commits at its sync without the killed group,
    whose shares of it are skipped and counted; the survivor loses no inner step."""
    events_dir = tmp_path / "events"
    args = job_args(lighthouse, tmp_path, 2, 10_000, "--sync", "localsgd", "--sync-every", "4", "--batch-policy",
                    "shrink", "--ranks-per-group", "1", "--local-batch-size", "2")
    g0, g1 = groups(0, args).start(), groups(1, args).start()
    wait_for(lambda: all(len([s for s in syncs(read_events(events_dir), g) if s["committed"] and s["members"] == 2])
                         >= 2 for g in (0, 1)), 240, "both groups to commit 2 syncs together")
    killed_at = g1.kill()
    wait_for(lambda: len([s for s in syncs(read_events(events_dir, 0), 0, killed_at) if s["committed"]]) >= 2, 90,
             "group 0 to commit 2 syncs alone")
    g0.stop()
    events = read_events(events_dir)
    after = [e for e in events if e["type"] == "step" and e["group"] == 0 and e["rank"] == 0 and e["ts"] >= killed_at]
    assert after and all(e["committed"] for e in after), [e for e in after if not e["committed"]]
    assert all(not s.get("error") for s in syncs(events, 0, killed_at))
    planned, once, twice, skipped = coverage(events, tmp_path)
    steps = {e["step"]: e for g in (0, 1) for e in committed_steps(events, g) if e["consumed"]}
    halves = [step for step, e in steps.items() if e["step_samples"] == 2]  # alone: its own half of the batch
    assert twice == 0 and skipped == 2 * len(halves) > 0 and once == planned - skipped


def test_diloco_groups_all_back_from_a_checkpoint_resume_its_synced_state_exactly(lighthouse, groups, tmp_path):
    """Checkpoints are written at syncs: the last synced parameters and the outer optimizer's
    momentum. Every group killed, every group back: they join at the checkpoint's step, with the
    very state its sync had (the fingerprint of the checkpoint's step, before and after)."""
    events_dir, ckpt = tmp_path / "events", tmp_path / "ckpt"
    args = job_args(lighthouse, tmp_path, 2, 10_000, "--sync", "diloco", "--sync-every", "5", "--checkpoint-dir",
                    str(ckpt), "--checkpoint-every", "10", "--no-checkpoint-async")
    first = [groups(g, args).start() for g in (0, 1)]
    wait_for(lambda: len(list(ckpt.glob("step-*"))) >= 2, 300, "two checkpoints")
    kill_together(first)
    step = int(sorted(ckpt.glob("step-*"))[-1].name.removeprefix("step-"))
    before = fingerprints(read_events(events_dir), 0)
    restarted_at = time.time()
    second = [groups(g, args).start() for g in (0, 1)]
    wait_for(lambda: all(any(s["committed"] and not s["joined"] for s in syncs(read_events(events_dir), g,
                                                                              restarted_at)) for g in (0, 1)),
             300, "both groups to commit a sync after the restart")
    for g in second:
        g.stop()
    events = [e for e in read_events(events_dir) if e["ts"] >= restarted_at]
    assert {e["resumed_step"] for e in events if e["type"] == "start"} == {step}
    after = {(e["step"], e["rank"]): e["digest"] for e in events if e["type"] == "fingerprint"}
    assert after[(step, 0)] == before[(step, 0)] and after[(step, 1)] == before[(step, 1)]
    assert min(e["step"] for g in (0, 1) for e in committed_steps(events, g)) == step + 1


def corrupted_after_two_syncs(lighthouse, groups, tmp_path: Path, **corruption):
    """2 groups of DiLoCo syncing every 5 steps; once they committed 2 syncs together, a drill's
    corruption (``corruption``: the injection's fields) injected into group 0. Returns the groups
    and when it was injected."""
    events_dir = tmp_path / "events"
    args = job_args(lighthouse, tmp_path, 2, 10_000, "--sync", "diloco", "--sync-every", "5")
    g0, g1 = groups(0, args).start(), groups(1, args).start()
    wait_for(lambda: synced_together(events_dir, 2), 240, "both groups to commit 2 syncs together")
    pids = [e["pid"] for e in read_events(events_dir, 0) if e["type"] == "start"]
    injected_at = time.time()
    write_model(events_dir / GroupLayout(0).injection,
                Injection(id=1, kind="corrupt", rank=None, pids=pids, seconds=0.0, scale=1e4, **corruption))
    return g0, g1, injected_at


def sdc_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "sdc"]


def test_a_corrupted_pseudo_gradient_is_caught_before_the_outer_step_and_judged_transient(
        lighthouse, groups, tmp_path):
    """A drill's corruption lands once in group 0's parameters before a sync (so in its
    pseudo-gradient): the norms exchanged after the all-reduce refuse the sync in both groups,
    nothing reaches the outer step; the window is trained again with the two groups' shares traded,
    group 0's pseudo-gradient is normal on group 1's shares and group 1's on group 0's, so the
    verdict is transient, the sync commits and the groups stay equal, every sample trained once."""
    events_dir = tmp_path / "events"
    g0, g1, injected_at = corrupted_after_two_syncs(lighthouse, groups, tmp_path)

    def refused_then_committed() -> bool:
        ev = read_events(events_dir)
        after = [s["step"] for s in syncs(ev, 0, injected_at) if s["committed"]]
        return all(any(not s["committed"] for s in syncs(ev, g, injected_at)) for g in (0, 1)) and bool(after) \
            and all((after[0], 0) in fingerprints(ev, g) for g in (0, 1))

    wait_for(refused_then_committed, 120, "both groups to refuse a sync, then commit one and fingerprint it")
    events = read_events(events_dir)  # before the stops: the group left after one refuses a sync too
    g0.stop()
    g1.stop()
    for g in (0, 1):
        refused = [s for s in syncs(events, g, injected_at) if not s["committed"]]
        assert len(refused) == 1 and "PseudoGradientAbnormal" in refused[0]["error"], refused
        assert "group 0's pseudo-gradient norm is" in refused[0]["error"]
    [sdc] = sdc_events(events)
    assert (sdc["group"], sdc["checker_group"], sdc["verdict"], sdc["action"]) == (0, 1, "transient", "skipped")
    assert sdc["step"] == refused[0]["step"] and sdc["norms"]["0"] > 1000 * sdc["norms"]["1"]
    fp0, fp1 = fingerprints(events, 0), fingerprints(events, 1)
    shared = sorted(set(fp0) & set(fp1))
    assert any(step > refused[0]["step"] for step, _ in shared)
    assert not [k for k in shared if fp0[k] != fp1[k]], "a corrupted outer step would part the groups"
    planned, once, twice, skipped = coverage(events, tmp_path)
    assert (once, twice, skipped) == (planned, 0, 0)


def test_a_group_corrupting_every_window_is_judged_persistent_and_quarantined(lighthouse, groups, tmp_path):
    """Group 0 corrupts its parameters before every sync, as a bad chip would: flagged at one sync,
    flagged again on group 1's shares in the retrained window while group 1 is normal on its
    shares, so persistent: group 0 quarantines itself and leaves, group 1 trains on alone and no
    sample is trained twice or skipped."""
    events_dir = tmp_path / "events"
    g0, g1, injected_at = corrupted_after_two_syncs(lighthouse, groups, tmp_path, persistent=True,
                                                    until=time.time() + 600)
    wait_for(lambda: any(e["type"] == "exit" and e["reason"] == "quarantined" for e in read_events(events_dir, 0)),
             120, "group 0 to quarantine itself")
    quarantined_at = time.time()
    wait_for(lambda: any(s["committed"] for s in syncs(read_events(events_dir, 1), 1, quarantined_at)), 120,
             "group 1 to commit a sync alone")
    events = read_events(events_dir)
    g1.stop()
    g0.stop()
    [sdc] = sdc_events(events)
    assert (sdc["group"], sdc["checker_group"], sdc["verdict"], sdc["action"]) == (0, 1, "persistent", "quarantined")
    assert sdc["rerun_norm"] > 1000 * sdc["checker_norm"], "flagged again on the checker's shares"
    assert (events_dir / GroupLayout(0).quarantine).exists()
    assert not [s for s in syncs(events, 1, injected_at) if s["committed"] and s["members"] == 2], \
        "no window group 0 trained is committed once it corrupts"
    planned, once, twice, skipped = coverage(events, tmp_path)
    assert planned > 0 and (once, twice, skipped) == (planned, 0, 0)
