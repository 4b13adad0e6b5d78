"""The straggler detector, on step events as rank 0 of each group writes them."""

from __future__ import annotations

import pytest

from bench.events import step_event
from protocol.events import ProcessEvent, StepEvent, StragglerEvent
from service.controlplane.stragglers import StepSample, StragglerTracker, eviction_pays, judge

T0 = 1_800_000_000.0


def step(group: int, n: int, compute_s: float, allreduce_s: float, **fields) -> StepEvent:
    return step_event(group, n, T0 + n, 3, step_s=compute_s + allreduce_s, compute_s=compute_s,
                      allreduce_s=allreduce_s, commit_s=0.01, **fields)


def window(pairs: list[tuple[float, float]], first: int = 1) -> list[StepSample]:
    return [StepSample(first + i, c, w) for i, (c, w) in enumerate(pairs)]


def test_a_group_that_computes_long_and_waits_least_is_a_persistent_straggler():
    fast, slow = (0.30, 0.12), (0.42, 0.01)
    verdict = judge({0: window([fast] * 8), 1: window([slow] * 8), 2: window([fast] * 8)}, {1: 0.30}, factor=1.15)
    assert (verdict.pattern, verdict.group) == ("persistent", 1)
    assert verdict.slowdown == pytest.approx(1.4)
    s = verdict.scores[1]
    assert s.relative == pytest.approx(0.30 / 0.42), "the fastest group's median over its own"
    assert s.individual == pytest.approx(0.30 / 0.42), "its best median over its current one"
    assert s.slowest_share == 1.0
    assert verdict.scores[0].relative == 1.0


def test_slowness_that_moves_from_group_to_group_is_rotating_not_a_straggler():
    """Data imbalance: a different group is slow each step; no group's median stands out."""
    windows = {g: window([(0.45, 0.01) if n % 3 == g else (0.30, 0.15) for n in range(1, 10)]) for g in range(3)}
    verdict = judge(windows, {}, factor=1.15)
    assert verdict.pattern == "rotating"
    assert verdict.group is None
    assert all(s.slowest_share < 0.5 for s in verdict.scores.values())


def test_a_group_slower_than_the_factor_allows_but_waiting_like_the_others_is_not_flagged():
    """It computes long, but it is not what the others wait for (it waits as long as they do)."""
    verdict = judge({0: window([(0.30, 0.10)] * 8), 1: window([(0.40, 0.10)] * 8), 2: window([(0.30, 0.05)] * 8)},
                    {}, factor=1.15)
    assert verdict.pattern != "persistent"


def test_small_differences_and_a_single_group_are_no_verdict():
    assert judge({0: window([(0.30, 0.1)] * 8), 1: window([(0.33, 0.0)] * 8)}, {}, 1.15).pattern == "none"
    assert judge({0: window([(0.30, 0.1)] * 8)}, {}, 1.15).pattern == "none"


def test_the_individual_score_tells_a_group_that_slowed_down_with_everyone():
    verdict = judge({0: window([(0.60, 0.1)] * 8), 1: window([(0.60, 0.1)] * 8)}, {0: 0.30, 1: 0.30}, 1.15)
    assert verdict.pattern == "none"
    assert verdict.scores[0].individual == pytest.approx(0.5)


@pytest.mark.parametrize("slowdown, groups, pays", [(1.1, 2, False), (1.4, 2, False), (2.5, 2, True),
                                                      (1.4, 4, True), (1.2, 8, True), (1.1, 8, False)])
def test_evicting_pays_only_when_the_slowdown_costs_more_than_the_groups_share(slowdown, groups, pays):
    assert eviction_pays(slowdown, groups) is pays


def feed(tracker: StragglerTracker, events) -> list[StragglerEvent]:
    return [out for e in events for out in tracker.observe(e)]


def test_the_tracker_flags_once_clears_once_and_says_which_side_of_the_eviction_line_it_was():
    tracker = StragglerTracker(window=6, factor=1.15, policy="evict")
    normal = [step(g, n, 0.30, 0.10) for n in range(1, 8) for g in range(2)]
    assert feed(tracker, normal) == []
    slow = [e for n in range(8, 16) for e in (step(0, n, 0.30, 0.90), step(1, n, 1.20, 0.01))]
    flagged = feed(tracker, slow)
    assert [(e.group, e.action) for e in flagged] == [(1, "flagged")]
    f = flagged[0]
    assert f.slowdown == pytest.approx(2.5), "flagged as soon as its median turned: (0.3 + 1.2) / 2 over 0.3"
    assert f.keep_cost == pytest.approx(0.6) and f.evict_cost == 0.5
    assert f.policy_action == "evict", "keeping it costs 60%, evicting it 50%"
    assert "evicting pays" in f.detail
    back = [e for n in range(16, 24) for e in (step(0, n, 0.30, 0.10), step(1, n, 0.30, 0.10))]
    assert [(e.group, e.action) for e in feed(tracker, back)] == [(1, "cleared")]


def test_a_mild_straggler_is_only_flagged_under_evict_when_keeping_it_is_cheaper():
    tracker = StragglerTracker(window=6, factor=1.15, policy="evict")
    events = [e for n in range(1, 10) for e in (step(0, n, 0.30, 0.12), step(1, n, 0.42, 0.01))]
    flagged = feed(tracker, events)
    assert [(e.group, e.policy_action) for e in flagged] == [(1, "flag")]
    assert "keeping it is cheaper" in flagged[0].detail


def test_a_flagged_group_that_goes_down_is_cleared_and_its_window_forgotten():
    tracker = StragglerTracker(window=4, factor=1.15, policy="flag")
    feed(tracker, [e for n in range(1, 6) for e in (step(0, n, 0.30, 0.5), step(1, n, 0.9, 0.0))])
    assert tracker.flagged == 1
    out = tracker.observe(ProcessEvent(group=1, ts=T0 + 6, action="killed"))
    assert [(e.group, e.action) for e in out] == [(1, "cleared")]
    assert 1 not in tracker.samples and tracker.flagged is None


def test_heal_steps_and_steps_of_other_ranks_are_not_counted():
    tracker = StragglerTracker(window=3, factor=1.15, policy="flag")
    tracker.observe(step(0, 1, 5.0, 0.0, ))
    tracker.observe(StepEvent(**{**step(1, 1, 5.0, 0.0).model_dump(), "rank": 1}))
    tracker.observe(StepEvent(**{**step(1, 2, 5.0, 0.0).model_dump(), "healed": True}))
    assert [len(w) for w in tracker.samples.values()] == [1]


def test_the_peers_median_leaves_out_the_group_itself():
    from service.controlplane.stragglers import _medians_of_the_others

    values = {0: 0.3, 1: 0.9, 2: 0.3, 3: 0.5}
    assert _medians_of_the_others(values) == {0: 0.5, 1: 0.3, 2: 0.5, 3: 0.3}
    assert _medians_of_the_others({0: 1.0, 1: 2.0}) == {0: 2.0, 1: 1.0}
