"""The decisions of --sync localsgd|diloco that need no processes: the window's veto, whose shares a
sync commits, and how --sync and its knobs resolve against a torchtitan config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.config import TrainerConfig
from trainer.errors import ConfigError
from trainer.job import find_config, sync_settings
from trainer.semi_sync import Window, shared_members, window_veto

WINDOW = Window(members=frozenset({"group0:a", "group1:b", "group2:c"}), slot=1, size=3)


def test_a_window_commits_when_every_group_that_trained_it_is_at_its_sync_newcomers_or_not():
    assert window_veto("constant", WINDOW, ["group0:a", "group1:b", "group2:c"]) is None
    assert window_veto("constant", WINDOW, ["group0:a", "group1:b", "group2:c", "group3:d"]) is None


def test_with_constant_a_group_missing_from_the_sync_sends_the_window_back_naming_it():
    why = window_veto("constant", WINDOW, ["group0:a", "group1:b", "group2:e"])  # group 2 restarted: a new id
    assert why is not None and why.startswith("group2 trained this window")


def test_with_shrink_or_without_a_window_nothing_is_vetoed():
    assert window_veto("shrink", WINDOW, ["group0:a"]) is None
    assert window_veto("constant", None, ["group0:a"]) is None  # a join: the group trained nothing
    assert window_veto("constant", Window(WINDOW.members, None, 3), ["group0:a"]) is None


def test_a_sync_commits_the_shares_of_the_groups_that_trained_the_window_and_are_there():
    assert shared_members(WINDOW, ["group0:a", "group2:c", "group3:d"]) == 2
    assert shared_members(None, ["group0:a"]) == 0


def trainer(**fields) -> TrainerConfig:
    return TrainerConfig(**fields)


def test_hsdp_is_the_default_and_each_knob_defaults_as_torchtitans_experiment_does():
    job = SimpleNamespace()  # a config without fault_tolerance, as the service's own
    assert not sync_settings(trainer(), job).semi_sync
    s = sync_settings(trainer(sync="diloco", steps=40), job)
    assert (s.mode, s.sync_every, s.fragments, s.outer_lr, s.outer_momentum, s.every) == ("diloco", 20, 1, 0.7, 0.9, 20)


def test_a_torchtitan_torchft_config_brings_its_own_semi_sync_method_and_the_flags_override_it():
    job = find_config("torchtitan.experiments.torchft.llama3.config_registry:llama3_torchft_debugmodel")()
    s = sync_settings(trainer(steps=100), job)
    assert (s.mode, s.sync_every, s.fragments, s.every) == ("diloco", 10, 2, 5)
    s = sync_settings(trainer(steps=100, sync="localsgd", sync_every=4, fragments=1), job)
    assert (s.mode, s.sync_every, s.fragments) == ("localsgd", 4, 1)
    assert not sync_settings(trainer(steps=100, sync="hsdp"), job).semi_sync


@pytest.mark.parametrize("fields, says", [
    (dict(sync="diloco", steps=50, sync_every=20), "--steps 50 is not a multiple of the 20 inner steps"),
    (dict(sync="diloco", steps=60, sync_every=20, fragments=3), "--sync-every 20 does not divide into --fragments 3"),
    (dict(sync="localsgd", steps=40, world_size_mode="fixed_with_spares"), "--world-size-mode dynamic only"),
])
def test_a_combination_that_cannot_train_is_one_line(fields, says):
    with pytest.raises(ConfigError, match=says):
        sync_settings(trainer(**fields), SimpleNamespace())


@pytest.mark.parametrize("written_semi, mode, says", [
    (False, "diloco", "written by a --sync hsdp job and this one runs --sync diloco"),
    (True, "hsdp", "written by a --sync localsgd or diloco job and this one runs --sync hsdp"),
])
def test_a_checkpoint_of_the_other_kind_of_sync_is_refused_in_one_line(tmp_path, written_semi, mode, says):
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import SEMI_SYNC_KEY, step_dir_name
    from trainer.launch import resume_step

    state = {"model": {"w": torch.ones(3)}} | ({SEMI_SYNC_KEY: {"step": 10}} if written_semi else {})
    dcp.save(state, checkpoint_id=tmp_path / step_dir_name(10), no_dist=True)
    with pytest.raises(ConfigError, match=says):
        resume_step(trainer(checkpoint_dir=tmp_path, steps=100), mode)
    assert resume_step(trainer(checkpoint_dir=tmp_path, steps=100), "localsgd" if written_semi else "hsdp") == 10
