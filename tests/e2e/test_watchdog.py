"""The hang watchdog's decision, on beacons as ranks write them: no processes needed."""

from __future__ import annotations

from protocol.beacon import Beacon
from service.agent.watchdog import WatchdogSettings, hang_verdict, step_bound

S = WatchdogSettings(interval_s=0.1, silence_s=1.0, floor_s=1.0, factor=3.0, min_steps=5, checkpoint_s=300.0)
NOW = 1_800_000_000.0
PIDS = {101, 102}
STEPS = [0.4, 0.45, 0.5, 0.4, 0.42, 0.47]  # median 0.435 s: bound max(1.0, 1.305) = 1.305 s


def beacon(phase: str, in_phase_s: float, age_s: float = 0.05, pid: int = 101, step: int = 40,
           starved_s: float = 0.0) -> Beacon:
    return Beacon(pid=pid, phase=phase, since=NOW - in_phase_s, step=step, ts=NOW - age_s, starved_s=starved_s)


def verdict(*beacons: Beacon | None, steps=STEPS) -> str | None:
    return hang_verdict(NOW, dict(enumerate(beacons)), PIDS, steps, S)


def test_a_healthy_group_is_not_hung():
    assert verdict(beacon("compute", 0.3), beacon("allreduce", 0.2, pid=102)) is None


def test_a_stopped_rank_is_hung_by_its_silence_whatever_its_phase():
    said = verdict(beacon("compute", 0.2), beacon("allreduce", 3.0, age_s=1.2, pid=102))
    assert said == "rank 1 silent for 1.2 s (bound 1 s): stopped or wedged in allreduce"


def test_a_rank_stuck_in_its_step_is_hung_past_the_adaptive_bound():
    assert step_bound(S, STEPS) == 3.0 * 0.435
    assert verdict(beacon("compute", 1.2), None) is None
    said = verdict(beacon("compute", 1.4), None)
    assert said == "rank 0 in compute at step 40 for 1.4 s (bound 1.3 s: 3 × median step 0.43 s, floor 1 s)"
    assert verdict(beacon("commit", 1.4), None).startswith("rank 0 in commit")


def test_a_rank_stuck_in_its_step_names_the_ranks_that_wait_for_it_too():
    """Rank 1 sleeps in its forward; rank 0 waits for it in FSDP's all-gather, in the same phase."""
    said = verdict(beacon("compute", 1.5), beacon("compute", 1.6, pid=102))
    assert said == "ranks 0, 1 in compute at step 40 for 1.6 s (bound 1.3 s: 3 × median step 0.43 s, floor 1 s)"
    # rank 0 entered its all-gather a moment before the stuck rank 1 began to sleep: the group is
    # hung once both are over the bound, named by the one longest in its phase
    assert verdict(beacon("compute", 1.4), beacon("compute", 1.2, pid=102)) is None
    said = verdict(beacon("compute", 1.42), beacon("compute", 1.35, pid=102))
    assert said == "ranks 0, 1 in compute at step 40 for 1.4 s (bound 1.3 s: 3 × median step 0.43 s, floor 1 s)"
    assert verdict(beacon("compute", 1.4), beacon("compute", 0.1, pid=102, step=41)).startswith("rank 0 in compute")


def test_time_spent_waiting_for_a_cpu_is_slow_not_stuck():
    """A busy machine (a browser starting beside three groups on two cores) keeps a rank runnable
    but off the CPU: its phase lasts past the bound, its beacon says how much of it was that wait."""
    assert verdict(beacon("compute", 1.6, starved_s=0.9)) is None
    said = verdict(beacon("compute", 2.5, starved_s=0.9))
    assert said == ("rank 0 in compute at step 40 for 2.5 s (0.9 s of it waiting for a CPU, not counted) "
                    "(bound 1.3 s: 3 × median step 0.43 s, floor 1 s)")
    # the starved rank keeps its peer blocked in FSDP's all-gather: no CPU wait there, but the
    # group is not hung while the rank it waits for is under the bound
    assert verdict(beacon("compute", 1.6), beacon("compute", 1.6, pid=102, starved_s=0.8)) is None
    # a rank stuck sleeping is off the CPU by its own doing: it waits for nothing, and is hung
    assert verdict(beacon("compute", 1.6), beacon("compute", 1.6, pid=102, starved_s=0.01)).startswith("ranks 0, 1")


def test_waiting_on_other_groups_or_starting_is_never_a_hang():
    for phase in ("allreduce", "starting", "idle"):
        assert verdict(beacon(phase, 600.0)) is None, phase


def test_twice_the_usual_step_is_not_a_hang():
    assert verdict(beacon("compute", 2 * 0.435)) is None


def test_a_slow_checkpoint_has_its_own_bound():
    assert verdict(beacon("checkpoint", 60.0)) is None
    assert verdict(beacon("checkpoint", 301.0)) == "rank 0 saving a checkpoint for 301.0 s (bound 300 s)"


def test_the_bound_waits_for_enough_steps_and_has_a_floor():
    assert verdict(beacon("compute", 5.0), steps=STEPS[:4]) is None  # a rejoined group's first steps
    fast = [0.05] * 10
    assert step_bound(S, fast) == 1.0
    assert verdict(beacon("compute", 0.9), steps=fast) is None


def test_beacons_of_other_processes_are_not_judged():
    """A beacon left by an earlier start of the group, or by a warm spare, names another pid."""
    assert verdict(beacon("compute", 50.0, age_s=50.0, pid=999)) is None
