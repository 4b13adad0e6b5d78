"""When a group that went down by itself starts again (``service/agent/restarts.py``)."""

from __future__ import annotations

from service.agent.restarts import RestartPlan, RestartPolicy, restart_plan

POLICY = RestartPolicy(backoff_cap_s=60.0, limit=5, window_s=600.0, cooldown_s=300.0)


def plans(policy: RestartPolicy, exits: list[float]) -> list[RestartPlan]:
    """The plan after each exit, the group's failures so far as the supervisor keeps them."""
    return [restart_plan(policy, exits[: i + 1], t) for i, t in enumerate(exits)]


def test_the_first_restart_is_at_once_then_the_waits_double_until_a_crash_loop_holds_the_group():
    got = plans(POLICY, [0.0, 10.0, 20.0, 30.0, 40.0, 350.0])
    assert [(p.delay_s, p.failures, p.crash_loop) for p in got] == [
        (0.0, 1, False), (1.0, 2, False), (2.0, 3, False), (4.0, 4, False),
        (300.0, 5, True),  # five in ten minutes: held for the cool-down
        (300.0, 6, True),  # tried after it and failed again: held again while its failures are recent
    ]


def test_failures_older_than_the_window_are_forgotten():
    """A group that ran well for longer than the window starts again at once."""
    assert restart_plan(POLICY, [0.0, 10.0, 20.0, 30.0, 700.0], 700.0) == RestartPlan(0.0, 1, crash_loop=False)
    # the first two have aged out: the sixth exit is the fourth in the window, not a crash loop
    assert restart_plan(POLICY, [0.0, 10.0, 20.0, 30.0, 40.0, 615.0], 615.0) == RestartPlan(4.0, 4, crash_loop=False)


def test_the_wait_never_passes_the_cap():
    policy = RestartPolicy(backoff_cap_s=5.0, limit=100, window_s=600.0, cooldown_s=300.0)
    assert [p.delay_s for p in plans(policy, [float(t) for t in range(10)])] == [0, 1, 2, 4, 5, 5, 5, 5, 5, 5]


def test_a_limit_of_one_holds_the_group_at_its_first_failure():
    assert restart_plan(RestartPolicy(limit=1, cooldown_s=30.0), [5.0], 5.0) == RestartPlan(30.0, 1, crash_loop=True)
