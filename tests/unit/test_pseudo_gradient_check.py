"""The pseudo-gradient check's decisions (``trainer/pseudo_gradient_check.py``) on exchanged
vectors as the groups send them: which sync is refused, who becomes a suspect and checks it, whose
shares each trains in the window trained again, and the verdict at the next sync."""

from __future__ import annotations

import math

import pytest

from trainer.pseudo_gradient_check import PseudoGradientCheck, window_verdict

FACTOR = 10.0


def exchanged(*slots: tuple[float, int, int] | None) -> list[float]:
    """The SUM of every participant's part: (drift, group, next window slot) per participating
    slot; None where a group joined (it sends zeros)."""
    checks = [PseudoGradientCheck(group, FACTOR) for _, group, _ in filter(None, slots)]
    total = [0.0] * (3 * len(slots))
    for slot, part in enumerate(slots):
        if part is not None:
            drift, group, next_slot = part
            sent = next(c for c in checks if c.group == group).sent(len(slots), slot, drift, next_slot)
            total = [a + b for a, b in zip(total, sent)]
    return total


def flagged_at_first_sync(group: int) -> PseudoGradientCheck:
    """Group ``group``'s view after a sync where group 1 (slot 1 now, slot 2 in the next window)
    was flagged among 3, group 0 (next slot 0) and group 2 (next slot 1) clean."""
    check = PseudoGradientCheck(group, FACTOR)
    decision = check.decide(exchanged((5.0, 0, 0), (7000.0, 1, 2), (6.0, 2, 1)))
    assert decision.refused is not None and decision.refused.startswith(
        "group 1's pseudo-gradient norm is 1.27e+03x the others'")
    assert not decision.incidents and not decision.skip_window
    return check


def test_normal_norms_pass_and_a_joined_slot_is_no_norm():
    check = PseudoGradientCheck(0, FACTOR)
    decision = check.decide(exchanged((5.0, 0, 0), (6.0, 1, 1), None))  # a third group joined: zeros
    assert decision.refused is None and not check.suspects and not decision.incidents
    assert check.traded() is None


def test_a_flagged_group_and_its_checker_trade_shares_in_the_window_trained_again():
    suspect, checker, bystander = (flagged_at_first_sync(g) for g in (1, 0, 2))
    assert suspect.traded() == (0, 0)  # group 0's slot and shares in the next window
    assert checker.traded() == (2, 1)  # group 1's
    assert bystander.traded() is None
    [s] = suspect.suspects
    assert (s.group, s.checker, s.reference) == (1, 0, 5.5)


@pytest.mark.parametrize("again, verdict, refused, skipped", [
    # (group 1 on group 0's shares, group 0 on group 1's shares, group 2 on its own)
    ((5.2, 0, 0, 6.1, 1, 2, 5.9, 2, 1), "transient", False, False),
    ((8000.0, 0, 0, 6.1, 1, 2, 5.9, 2, 1), "persistent", True, False),
    ((5.2, 0, 0, 9000.0, 1, 2, 5.9, 2, 1), "data", True, True),
])
def test_the_next_sync_gives_the_verdict(again, verdict, refused, skipped):
    # slots: group 1's norm first (it is participating rank 0 at this sync), then group 0, group 2
    slots = [(again[0], 1, again[2]), (again[3], 0, again[5]), (again[6], 2, again[8])]
    views = [flagged_at_first_sync(g) for g in (0, 1, 2)]
    decisions = [view.decide(exchanged(*slots)) for view in views]
    decision = decisions[0]
    assert all(d == decision for d in decisions)  # every group alike
    [incident] = decision.incidents
    assert (incident.group, incident.checker_group, incident.verdict) == (1, 0, verdict)
    assert incident.norms == {0: 5.0, 1: 7000.0, 2: 6.0}  # the norms that flagged it
    assert (decision.refused is not None, decision.skip_window) == (refused, skipped)
    assert not any(view.suspects for view in views), "a group explained by a verdict is not suspected again"
    assert all(view.traded() is None for view in views)


def test_the_suspects_travel_with_the_synced_point_to_a_group_that_joins():
    source = flagged_at_first_sync(0)
    joined = PseudoGradientCheck(3, FACTOR)
    joined.load_state(source.state())
    assert joined.suspects == source.suspects
    later = exchanged((5.2, 1, 0), (9000.0, 0, 2), None)
    assert joined.decide(later).skip_window and source.decide(later).skip_window


def test_a_suspect_whose_checker_left_is_not_judged_and_a_failed_exchange_drops_the_suspects():
    check = flagged_at_first_sync(2)
    decision = check.decide(exchanged((5.2, 1, 0), (5.9, 2, 1)))  # group 0, the checker, is gone
    assert not decision.incidents and decision.refused is None
    check = flagged_at_first_sync(2)
    assert check.decide(None).refused is None and not check.suspects


def test_a_norm_that_is_not_finite_is_flagged_as_such():
    check = PseudoGradientCheck(0, FACTOR)
    assert "not finite" in check.decide(exchanged((5.0, 0, 0), (math.nan, 1, 1))).refused


def test_verdicts():
    assert window_verdict(flagged_again=False, checker_flagged=False) == "transient"
    assert window_verdict(flagged_again=True, checker_flagged=False) == "persistent"
    assert window_verdict(flagged_again=False, checker_flagged=True) == "data"
    assert window_verdict(flagged_again=True, checker_flagged=True) == "data"
    assert window_verdict(flagged_again=True, checker_flagged=None) == "data"  # nobody could check
    assert window_verdict(flagged_again=False, checker_flagged=None) == "transient"
