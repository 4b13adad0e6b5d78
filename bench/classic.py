"""Running the classic baseline (bench/classic_trainer.py) as one torchrun job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO
from service.proctree import kill_tree, process_tree
from protocol.torchrun import free_port


def read_events(events_dir: Path) -> list[dict]:
    out = []
    for path in sorted(events_dir.glob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["ts"])


class ClassicJob:
    def __init__(self, workdir: Path, groups: int, ranks_per_group: int, trainer_args: list[str], max_restarts: int,
                 checkpoint_every: int | None):
        self.events_dir = workdir / "events"
        args = ["--groups", str(groups), "--ranks-per-group", str(ranks_per_group), "--steps", "1000000",
                "--events-dir", str(self.events_dir), *trainer_args]
        if checkpoint_every:
            args += ["--checkpoint-dir", str(workdir / "ckpt"), "--checkpoint-every", str(checkpoint_every)]
        self.log = open(workdir / "classic.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={groups * ranks_per_group}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=classic",
             f"--max-restarts={max_restarts}",
             "--monitor-interval=0.1", "-m", "bench.classic_trainer", *args],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                           "PYTHONUNBUFFERED": "1"},
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def events(self) -> list[dict]:
        return read_events(self.events_dir) if self.events_dir.exists() else []

    def last_step(self) -> int:
        steps = [e["step"] for e in self.events() if e["type"] == "step" and e["group"] == 0 and e["rank"] == 0]
        return steps[-1] if steps else 0

    def wait_step(self, step: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while self.last_step() < step:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"classic job did not reach step {step}")
            time.sleep(0.2)

    def kill_one_rank(self) -> float:
        """SIGKILL one worker (the last rank): torchrun tears the job down and restarts it."""
        workers = [p for p in process_tree(self.proc.pid)[1:] if "bench.classic_trainer" in " ".join(p.cmdline())]
        victim = max(workers, key=lambda p: p.pid)
        when = time.time()
        victim.send_signal(signal.SIGKILL)
        return when

    def stop(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()
        self.log.close()
