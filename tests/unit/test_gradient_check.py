"""The gradient check's decisions, on norms recorded from real drills, and its wiring into torch."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from protocol.events import SdcEvent
from protocol.files import write_model
from protocol.injection import Injection
from protocol.quarantine import Quarantine, quarantine_file, take_quarantine
from trainer.gradient_check import attribute, checkers, filled_slots, group_norm, judge, shard_norm
from trainer.hooks import DrillHooks

FACTOR = 10.0


@pytest.fixture
def gloo_group():
    """A one-rank gloo process group in this process, as a group of one rank has."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_recorded_transient_corruption_is_flagged_and_its_rerun_is_normal():
    """ftctl drill corrupt --group 1 (x1e4 once), 2 groups x 2 ranks: step 19."""
    j = judge([0, 1], [1.191644104319987, 85.28783398360434], FACTOR)
    assert j.flagged == [1] and j.clean == [0] and j.reference == pytest.approx(1.1916, rel=1e-4)
    assert checkers(j.flagged, j.clean) == {1: 0}
    assert attribute(1.9911916578754918, 1.9911916578754918, j.reference, FACTOR) == "transient"


def test_recorded_persistent_corruption_is_the_flagged_groups_own():
    """ftctl drill corrupt --group 0 --persistent: the rerun is as bad, group 1's rerun of the batch is not."""
    j = judge([0, 1], [871.8636736858919, 1.0862649528715997], FACTOR)
    assert j.flagged == [0] and checkers(j.flagged, j.clean) == {0: 1}
    assert attribute(871.8636736858919, 1.1083867500853122, j.reference, FACTOR) == "persistent"


def test_a_batch_abnormal_wherever_it_is_computed_is_the_data():
    assert attribute(900.0, 880.0, 1.1, FACTOR) == "data"
    assert attribute(900.0, None, 1.1, FACTOR) == "data", "nobody could check it: not blamed on the group"


def test_normal_steps_flag_nobody_and_a_small_norm_is_not_flagged():
    """Recorded norms of 3 healthy groups differ by about 20%; a far smaller one does little harm to an average."""
    assert judge([0, 1, 2], [1.08, 1.27, 0.96], FACTOR).flagged == []
    assert judge([0, 1, 2], [1.08, 1e-6, 0.96], FACTOR).flagged == []


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_norm_that_is_not_finite_is_flagged_and_does_not_taint_the_others(bad):
    j = judge([3, 5], [bad, 1.2], FACTOR)
    assert j.flagged == [0] and j.groups[j.flagged[0]] == 3 and j.reference == 1.2


def test_with_more_flagged_than_clean_groups_the_clean_ones_check_in_turn():
    j = judge([0, 1, 2, 3, 4], [1.0, 50.0, 1.1, math.nan, 70.0], FACTOR)
    assert j.flagged == [1, 3, 4] and j.clean == [0, 2]
    assert checkers(j.flagged, j.clean) == {1: 0, 3: 2, 4: 0}
    assert checkers([0, 1], []) == {0: None, 1: None}, "every group flagged: nobody to check"


def test_a_single_group_is_judged_only_on_finiteness():
    assert judge([0], [1e9], FACTOR).flagged == []
    assert judge([0], [math.nan], FACTOR).flagged == [0]


def test_norms_of_shards_add_up_as_squares():
    shards = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    assert shard_norm(shards) == pytest.approx(5.0)
    assert math.isnan(shard_norm([torch.tensor([1.0, math.nan])]))


def test_group_norm_reduces_inside_a_one_rank_group(gloo_group):
    assert group_norm([torch.tensor([6.0, 8.0])], torch.device("cpu")) == pytest.approx(10.0)


def test_an_injected_corruption_scales_the_largest_element_once(tmp_path):
    faults = DrillHooks(tmp_path, 0)
    try:
        faults._corrupt = Injection(id=1, kind="corrupt", rank=0, pids=[os.getpid()], seconds=60, scale=1e4)
        gradient = torch.tensor([0.1, -0.5, 0.2])
        assert faults.corrupt(gradient) is True
        assert gradient.tolist() == pytest.approx([0.1, -5000.0, 0.2])
        assert faults.corrupt(gradient) is False, "once: the rerun computes a clean gradient"
    finally:
        faults.close()


def test_a_quarantine_is_read_once(tmp_path):
    assert take_quarantine(tmp_path, 2) is None
    write_model(quarantine_file(tmp_path, 2), Quarantine(step=7, reason="persistent"))
    assert take_quarantine(tmp_path, 2) == Quarantine(step=7, reason="persistent")
    assert take_quarantine(tmp_path, 2) is None


def test_an_sdc_event_carries_a_norm_that_is_not_finite_as_null():
    e = SdcEvent(ts=1.0, group=1, rank=0, step=3, norms={0: 1.0, 1: None}, reference_norm=1.0, factor=10.0,
                 rerun_norm=None, checker_group=0, checker_norm=1.1, verdict="persistent", action="quarantined",
                 check_s=0.5)
    assert SdcEvent.model_validate_json(e.model_dump_json()) == e


def test_a_slot_nobody_filled_is_not_judged():
    """Recorded at step 0 of a compose job: group 1 healed at its first step (init sync), torchft
    counted it among the participants and sent zeros for it. Judged as a norm of 0, it made group
    0's 4.21 abnormal and its 'checker' normal: a healthy group was quarantined."""
    exchanged = [4.2103, 0.0, 1.0, 0.0]  # norms of slots 0 and 1, then group + 1 of each
    assert filled_slots(exchanged, 2) == [(0, 0, 4.2103)]
    assert judge([0], [4.2103], FACTOR).flagged == []
    three = [1.1, 0.0, 0.9, 1.0, 0.0, 3.0]
    assert filled_slots(three, 3) == [(0, 0, 1.1), (2, 2, 0.9)]
