"""The global sample order and who trains what (trainer/data.py), on recorded and made-up quorums."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from trainer.data import DataPlan, next_data_step, split


def plan(**kw) -> DataPlan:
    return DataPlan(**{"windows": 1000, "global_batch": 16, "local_batch": 4, "ranks": 2, "groups": 2,
                       "policy": "constant", "seed": 0, **kw})


def trained(p: DataPlan, data_step: int, slots: dict[int, int | None], participants: int) -> Counter:
    """Every sample each rank of each group (group -> slot) computes at ``data_step``, counted."""
    seen: Counter = Counter()
    for group, slot in slots.items():
        share = p.group_share(data_step, group, slot, participants)
        for rank in range(p.ranks):
            for piece in p.microbatches(share, rank, participants):
                seen.update(piece)
    return seen


@pytest.mark.parametrize("total, parts", [(16, 2), (16, 3), (7, 3), (2, 4), (0, 2)])
def test_split_cuts_a_range_into_contiguous_pieces_that_differ_by_one(total, parts):
    pieces = [split(total, parts, i) for i in range(parts)]
    assert [n for piece in pieces for n in piece] == list(range(total))
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


@pytest.mark.parametrize("groups, ranks, local, batch", [(2, 2, 4, 16), (3, 2, 2, 12), (3, 1, 2, 7), (4, 2, 1, 8)])
def test_constant_every_quorum_trains_the_whole_global_batch_once(groups, ranks, local, batch):
    p = plan(groups=groups, ranks=ranks, local_batch=local, global_batch=batch)
    for participants in range(1, groups + 1):
        for members in itertools.combinations(range(groups), participants):
            slots = {g: i for i, g in enumerate(members)}
            seen = trained(p, 5, slots, participants)
            assert set(seen) == set(range(5 * batch, 6 * batch)), f"quorum {members} misses or strays"
            assert set(seen.values()) == {1}, f"quorum {members} trains a sample twice"


def test_a_group_out_of_the_quorum_trains_nothing_and_the_others_accumulate_its_share():
    p = plan()
    assert p.group_share(3, 1, None, 1) == range(0)
    alone = p.group_share(3, 0, 0, 1)
    assert alone == range(48, 64)
    assert p.microbatch_count(1) == 2, "16 samples over 2 ranks of 4 at once: two microbatches each"
    assert p.microbatch_count(2) == 1
    assert p.microbatches(range(0), 1, 1) == [range(0), range(0)], "a healing group passes as often as the others"


def test_every_rank_of_every_group_makes_the_same_number_of_passes():
    """FSDP hands the output layer's gradient to the cross-group all-reduce apart from its norm's
    after one pass and together after several: every group must pass alike."""
    p = plan(global_batch=9, ranks=2, local_batch=4, groups=3)
    for participants in (1, 2, 3):
        counts = {len(p.microbatches(p.group_share(0, g, slot, participants), rank, participants))
                  for g, slot in ((0, 0), (1, participants - 1), (2, None)) for rank in range(2)}
        assert counts == {p.microbatch_count(participants)}
    passes = [p.microbatches(p.group_share(0, 0, 0, 1), rank, 1) for rank in range(2)]
    assert [len(m) for m in passes[0]] == [3, 2] and [len(m) for m in passes[1]] == [2, 2]


@pytest.mark.parametrize("participants, sizes", [(2, (8, 8)), (3, (6, 5, 5)), (1, (16,))])
def test_the_loss_divisors_weigh_every_sample_of_the_step_alike(participants, sizes):
    """FSDP sums over a group's ranks (torchtitan turns its division off) and torchft averages over
    the participants: a sample of group g weighs 1 / divisor_g / P, the same 1/B for every sample."""
    p = plan(groups=3)
    for size in sizes:
        weight = 1 / p.loss_divisor(participants, range(size)) / participants
        assert weight == pytest.approx(1 / 16, rel=1e-12)


def test_shrink_keeps_each_groups_share_and_skips_a_missing_ones():
    p = plan(policy="shrink")
    assert p.group_share(2, 1, 0, 1) == range(40, 48), "group 1 trains its own half whatever its slot"
    assert trained(p, 2, {1: 0}, 1).keys() == set(range(40, 48))
    assert p.step_samples(1) == 8 and p.step_samples(2) == 16
    assert p.loss_divisor(1, range(40, 48)) == 8, "the batch shrinks: the mean over what was trained"


def test_the_epoch_order_is_a_seeded_permutation_the_same_in_every_process():
    p = plan(windows=50)
    first = [p.window(n) for n in range(50)]
    assert sorted(first) == list(range(50)), "an epoch visits every window once"
    assert [p.window(n) for n in range(50, 100)] != first, "the next epoch is another order"
    assert [plan(windows=50).window(n) for n in range(50)] == first
    assert [plan(windows=50, seed=1).window(n) for n in range(50)] != first


@pytest.mark.parametrize("applied, verdict, expected", [
    (True, None, 4), (False, "transient", 3), (False, "persistent", 3), (False, "data", 4), (False, None, 3)])
def test_the_data_position_moves_on_when_the_batch_is_used_up(applied, verdict, expected):
    assert next_data_step(3, applied, verdict) == expected


def test_a_kill_and_heal_trains_every_sample_once():
    """The quorums of a 2-group kill-heal drill, step by step (constant, B=16): steps 0-3 both groups, group 1
    killed in step 4 (the step fails: no commit, the data position stays), steps 4-6 group 0 alone,
    step 7 group 1 heals (not participating), steps 8-9 both again."""
    p = plan()
    history = [({0: 0, 1: 1}, 2, True)] * 4 + [({0: 0, 1: 1}, 2, False)] + [({0: 0}, 1, True)] * 3 \
        + [({0: 0, 1: None}, 1, True)] + [({0: 0, 1: 1}, 2, True)] * 2
    data_step, seen = 0, Counter()
    for slots, participants, commits in history:
        if commits:
            seen += trained(p, data_step, slots, participants)
            data_step = next_data_step(data_step, True, None)
    assert seen.keys() == set(range(data_step * 16)) and set(seen.values()) == {1}
