"""The goodput ledger reproduces the three scenarios the seed prints (chapter 2 and 10)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster import REPO
from service.ledger import Cluster, NoProgress, Recovery, goodput, young_interval

SCENARIOS = {  # (detect, restart, load, delta) -> {gpus: (tau_opt minutes, goodput %, dominant)}
    "A": ((600, 300, 120, 300), {1024: (171.2, 93.76, "rollback"), 16384: (42.8, 70.76, "rollback")}),
    "B": ((600, 300, 120, 10), {1024: (31.2, 98.36, "rollback"), 16384: (7.8, 86.73, "detect")}),
    "C": ((60, 30, 60, 10), {1024: (31.2, 98.85, "rollback"), 16384: (7.8, 94.49, "rollback")}),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_seed_scenarios(name):
    (detect, restart, load, delta), rows = SCENARIOS[name]
    for gpus, (tau_min, percent, dominant) in rows.items():
        g = goodput(Cluster(gpus, 50_000), Recovery(detect, restart, load, delta))
        assert round(g.tau_s / 60, 1) == tau_min
        assert round(100 * g.goodput, 2) == percent
        assert g.dominant == dominant


def test_fixed_interval_and_term_shares():
    g = goodput(Cluster(16384, 50_000), Recovery(600, 300, 120, 300), tau_s=600)
    assert round(100 * g.goodput, 2) == 58.66
    assert {k: round(100 * v, 2) for k, v in g.terms.items()} == {
        "checkpoint": 29.33, "detect": 5.46, "restart": 2.73, "load": 1.09, "rollback": 2.73}
    assert young_interval(10, 10980) == pytest.approx(468.6, abs=0.1)


def test_loss_at_or_beyond_mtbf_is_an_error():
    with pytest.raises(NoProgress, match="never makes progress"):
        goodput(Cluster(16384, 100), Recovery(3600, 0, 0, 10))


def test_ftctl_ledger_prints_both_scales_and_fails_clearly():
    out = subprocess.run([sys.executable, "-m", "service.cli", "ledger", "--delta", "10"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "1024 GPUs" in out.stdout and "16384 GPUs" in out.stdout and "86.73%" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "service.cli", "ledger", "--gpu-mtbf-hours", "1", "--gpus", "16384"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("ftctl: error: loss per failure")
    healed = subprocess.run([sys.executable, "-m", "service.cli", "ledger", "--gpus", "16384", "--load", "3",
                             "--state-gb-per-rank", "12", "--heal-gb-per-s", "25"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert healed.returncode == 0 and "load 3.48s (3s + 12 GB at 25 GB/s)" in healed.stdout, healed.stderr
    half = subprocess.run([sys.executable, "-m", "service.cli", "ledger", "--state-gb-per-rank", "12"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert half.returncode != 0 and "--heal-gb-per-s together" in half.stderr
