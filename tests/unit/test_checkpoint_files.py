"""Which published checkpoint a restart loads, on real folders: only exact names, only manifests
that list every file of the right step, and anything else is a skip with a reason, never a crash."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from trainer.checkpoint import MANIFEST, newest_complete, published, step_dir_name, verify


def publish(root: Path, step: int, files: dict[str, bytes], manifest: object = None) -> Path:
    folder = root / step_dir_name(step)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    if manifest is None:
        manifest = {"step": step, "group": 0, "files": {
            name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def test_only_exact_names_are_checkpoints_and_a_bad_manifest_is_a_skip_not_a_crash(tmp_path):
    good = publish(tmp_path, 40, {"__0_0.distcp": b"weights", ".metadata": b"meta"})
    (tmp_path / "step-00000050.bak").mkdir()
    (tmp_path / "step-x").mkdir()
    (tmp_path / "step-00000090").write_text("a file, not a folder")
    shapes = {
        50: ["files", "step"],
        60: {"step": 60, "files": []},
        70: {"step": 70, "files": {}},
        80: {"step": 79, "files": {"a": {"size": 1, "sha256": hashlib.sha256(b"a").hexdigest()}}},
        85: {"step": 85, "files": {"a": "nonsense"}},
    }
    for step, manifest in shapes.items():
        publish(tmp_path, step, {"a": b"a"}, manifest)
    extra = publish(tmp_path, 88, {"a": b"a"})
    (extra / "planted.distcp").write_bytes(b"not saved by us")
    assert [p.name for p in published(tmp_path)] == [step_dir_name(s) for s in (40, 50, 60, 70, 80, 85, 88)]
    skipped: list[tuple[str, str]] = []
    found = newest_complete(tmp_path, lambda path, reason: skipped.append((path.name, reason)))
    assert found is not None and (found.step, found.path) == (40, good)
    reasons = dict(skipped)
    assert reasons[step_dir_name(88)] == "planted.distcp is not in the manifest"
    assert reasons[step_dir_name(85)].startswith("unreadable manifest")
    assert reasons[step_dir_name(80)] == "the manifest is of step 79, the folder's name says 80"
    assert reasons[step_dir_name(70)] == reasons[step_dir_name(60)] == "the manifest lists no files"
    assert reasons[step_dir_name(50)].startswith("unreadable manifest")
    assert verify(good) is None


def test_a_warm_spare_leaves_the_live_groups_save_in_flight_and_its_promotion_clears_it(tmp_path):
    """A warm spare starts beside the live group of its number: its resume must not take the
    live group's save in flight for a crash's leftover (that save then failed, and the group
    crashed, in the service's chaos test). Once promoted, the old processes are gone, and so goes
    their unfinished folder; another group's is never touched."""
    import torch.distributed as dist

    from trainer.checkpoint import Checkpointer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        root = tmp_path / "checkpoints"
        in_flight = root / f".{step_dir_name(60)}.tmp-g0"
        in_flight.mkdir(parents=True)
        (in_flight / "__0_0.distcp").write_bytes(b"being written")
        other = root / f".{step_dir_name(60)}.tmp-g1"
        other.mkdir()
        ckpt = Checkpointer(root, group=0, keep=2, every=10, state=dict, restore=lambda state: None,
                            asynchronous=False)
        assert ckpt.choose(print, clear_unpublished=False) is None
        assert in_flight.exists(), "the spare's resume removed the live group's save in flight"
        ckpt.clear_unpublished()
        assert not in_flight.exists() and other.exists()
    finally:
        dist.destroy_process_group()
