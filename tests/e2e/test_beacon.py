"""The progress beacon a real rank process writes: its phase, and how much of the phase it spent
waiting for a CPU, as the kernel counted it (the watchdog does not count that time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import REPO
from processes import Owner
from protocol.layout import GroupLayout
from protocol.beacon import read_beacon

RANK = """
import os, sys, time
from pathlib import Path
from trainer.telemetry import ProgressBeacon
os.sched_setaffinity(0, {0})
beacon = ProgressBeacon(Path(sys.argv[1]), 0, 0)
beacon.enter("compute", 7)
end = time.time() + 2.0
while time.time() < end:
    if sys.argv[2] == "spin":
        pass
    else:
        time.sleep(0.05)
"""
HOG = "import os, time\nos.sched_setaffinity(0, {0})\nwhile True: pass\n"


def rank_beacon(tmp_path: Path, work: str, hogged: bool):
    """Run a rank that spins (or sleeps) in compute for 2 s on CPU 0, beside a process that
    spins on CPU 0 too when ``hogged``; the beacon it wrote last."""
    with Owner() as owner:
        if hogged:
            subprocess.Popen([sys.executable, "-c", HOG], env=owner.env(), start_new_session=True)
        done = subprocess.run([sys.executable, "-c", RANK, str(tmp_path), work], env=owner.env(PYTHONPATH=str(REPO)),
                              capture_output=True, text=True, timeout=60, start_new_session=True)
    assert done.returncode == 0, done.stderr
    beacon = read_beacon(tmp_path / GroupLayout(0).beacon(0))
    assert beacon is not None and (beacon.phase, beacon.step) == ("compute", 7)
    return beacon


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="the kernel keeps no schedstat")
def test_a_rank_sharing_its_cpu_says_how_long_it_waited_for_it(tmp_path):
    beacon = rank_beacon(tmp_path, "spin", hogged=True)
    in_phase = beacon.ts - beacon.since
    assert 0.3 * in_phase < beacon.starved_s <= in_phase, beacon  # about half: two spinners, one CPU


def test_a_rank_sleeping_in_its_step_waits_for_nothing(tmp_path):
    """A rank stuck in a sleep (the hang drill's stuck rank) is off the CPU by its own doing."""
    beacon = rank_beacon(tmp_path, "sleep", hogged=True)
    assert beacon.starved_s < 0.1 * (beacon.ts - beacon.since), beacon
