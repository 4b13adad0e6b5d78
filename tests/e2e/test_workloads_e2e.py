"""A torchtitan user's own job under `ftctl up`: torchtitan's llama3 and qwen3 configs, a Hugging
Face tokenizer folder and JSONL data made here from local text, the global batch held constant.
It trains (the loss falls), a kill-heal drill ends with every group holding the same state, and
every sample of the job's order is trained exactly once. A bad job is refused before anything
starts, in one line.

Step times on this 2-core CPU: llama3_debugmodel in bf16 takes ~6 s a step (this CPU has no
bf16 matrix unit: ``--dtype bf16`` is for accelerators), qwen3_debugmodel in fp32 ~2 s.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import pytest

from bench.local_assets import make_jsonl, make_tokenizer
from cluster import REPO, wait_for
from processes import Owner
from service.client import ControlPlane
from up_job import all_training, ftctl_up, groups, job_snapshot


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return make_tokenizer(root / "tokenizer", vocab_size=1024), make_jsonl(root / "train.jsonl", files=40)


def committed_losses(control: ControlPlane, group: int) -> list[float]:
    events = control.events(group=group, type="step", limit=1000)
    return [e["loss"] for e in events if e["rank"] == 0 and e["committed"] and e["samples"] and e["loss"] is not None]


def drill(control: ControlPlane, body: dict, timeout_s: float = 600) -> dict:
    drill_id = control.start_drill(body)["id"]
    return wait_for(lambda: (d := control.drill(drill_id))["status"] != "running" and d,
                    timeout_s, f"drill {drill_id} to end", explain=lambda: job_snapshot(control))


@pytest.mark.parametrize("config, dtype, steps", [("llama3_debugmodel", "bf16", 10), ("qwen3_debugmodel", "fp32", 10)])
def test_a_torchtitan_config_with_its_own_tokenizer_and_data_trains_heals_and_covers_each_sample_once(
        assets, tmp_path, config, dtype, steps):
    tokenizer, data = assets
    job = ("--config", config, "--tokenizer", str(tokenizer), "--dataset", str(data), "--dtype", dtype,
           "--batch-policy", "constant", "--seq-len", "128", "--local-batch-size", "4",
           # a step here takes seconds: the collectives wait for the slower group that long
           "--trainer-arg=--timeout-s=60", "--trainer-arg=--fingerprint-every=1")
    with ftctl_up(tmp_path, groups=2, ranks_per_group=1, steps=steps, job=job) as up:
        control = up.control
        wait_for(lambda: all_training(control) and min(g["step"] or 0 for g in groups(control).values()) >= 2, 400,
                 "both groups training", explain=lambda: job_snapshot(control))
        d = drill(control, {"kind": "kill-heal", "group": 1})
        assert d["status"] == "done" and d["fingerprints_equal"] is True, d
        assert d["report"]["heal_bytes"] > 0
        wait_for(lambda: all(g["down_reason"] == "finished" for g in groups(control).values()), 600,
                 f"both groups to finish {steps} steps", explain=lambda: job_snapshot(control))

        data_view = control.data()
        assert data_view["job"]["config"] == config and data_view["job"]["dtype"] == dtype
        assert data_view["job"]["global_batch_size"] == 8 and data_view["job"]["batch_policy"] == "constant"
        assert data_view["samples_planned"] == 8 * steps, data_view
        assert (data_view["trained_once"], data_view["trained_twice"], data_view["skipped"]) == (8 * steps, 0, 0)
        losses = committed_losses(control, 0)
        assert statistics.mean(losses[-3:]) < statistics.mean(losses[:3]) - 0.3, losses


def test_a_bad_job_is_refused_in_one_line_before_anything_starts(assets, tmp_path):
    tokenizer, data = assets
    big = make_tokenizer(tmp_path / "big-tokenizer", vocab_size=3000)

    def up(*args: str) -> subprocess.CompletedProcess:
        owner = Owner()
        try:
            return subprocess.run([sys.executable, "-m", "service.cli", "up", "--state-dir", str(tmp_path / "state"),
                                   *args], cwd=REPO, env=owner.env(), capture_output=True, text=True, timeout=120)
        finally:
            assert owner.end() == [], "the refused job left a process behind"

    for args, message in [
        (("--config", "llama3_debugmodel", "--tokenizer", str(big), "--dataset", str(data)),
         "the tokenizer has 3000 tokens but llama3_debugmodel's embedding holds 2048"),
        (("--config", "llama3_debugmodel", "--tokenizer", str(tmp_path / "none")), "--tokenizer"),
        (("--dataset", str(tmp_path / "missing.jsonl")), "missing.jsonl does not exist"),
        (("--config", "qwen3_debugmodel", "--tokenizer", str(tokenizer), "--dataset", str(data),
          "--seq-len", "5000"), "--seq-len 5000 is longer than qwen3_debugmodel allows (4096 tokens)"),
        (("--trainer-arg=--flavor=nope",), "unrecognized arguments: --flavor=nope"),
    ]:
        started = time.time()
        result = up(*args)
        errors = result.stderr.strip().splitlines()
        assert result.returncode == 2 and errors == [f"ftctl: error: {errors[0].removeprefix('ftctl: error: ')}"], \
            result.stdout + result.stderr
        assert message in errors[0], (message, errors)
        assert not (tmp_path / "state" / "connection.json").exists(), "something started"
        assert time.time() - started < 60
