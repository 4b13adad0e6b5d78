"""The CUDA path, checked on one GPU: what ``bench/gpu_check.sh`` runs (under 8 minutes on an H100).

Two replica groups × 1 rank share ``cuda:0`` (NCCL inside each group; across groups gloo, as
torchtitan's torchft integration does by default: two processes cannot share one GPU in one NCCL
communicator). The job is torchtitan's Llama 3 1B flavor (1.24B parameters) in bf16, with a BPE
tokenizer and JSONL data made from the machine's own Python sources. After a few steps it runs a
kill-heal, a hang and a corrupt drill through the control plane and writes one JSON: step time,
tokens per second, each drill's report (heal bytes and seconds, the timeline, fingerprints) and
the data coverage.

    python -m bench.gpu_check --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import Up, write_result
from bench.local_assets import make_jsonl, make_tokenizer

DRILLS = [{"kind": "kill-heal", "group": 1}, {"kind": "hang", "group": 0, "mode": "stop"},
          {"kind": "corrupt", "group": 1, "scale": 1e4}]


def gpu() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "unknown"


def steps(up: Up, since: float) -> list[dict]:
    events = up.control.events(type="step", since=since, limit=1000)
    return [e for e in events if e["rank"] == 0 and e["committed"] and e["participants"] == 2 and e["samples"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--config", default="llama3_1b")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--local-batch-size", type=int, default=4)
    parser.add_argument("--measure-steps", type=int, default=5)
    args = parser.parse_args()
    began = time.time()
    work = Path(tempfile.mkdtemp(prefix="ftgpu-"))
    tokenizer = make_tokenizer(work / "tokenizer", vocab_size=32000, files=300)
    dataset = make_jsonl(work / "train.jsonl", files=120, skip=300)
    job = ["--device=cuda", "--replicate-backend=gloo", f"--config={args.config}", f"--tokenizer={tokenizer}",
           f"--dataset={dataset}", "--dtype=bf16", f"--seq-len={args.seq_len}",
           f"--local-batch-size={args.local_batch_size}", "--timeout-s=120", "--fingerprint-every=1",
           "--checkpoint-every=1000000"]
    up = Up(work / "state", groups=2, ranks_per_group=1, trainer_args=job)
    result: dict = {"gpu": gpu(), "job": job}
    try:
        up.wait_training(timeout_s=240)
        measured_from = time.time()
        while len(steps(up, measured_from)) < 2 * args.measure_steps:
            time.sleep(1)
        measured = steps(up, measured_from)
        result["step_s"] = statistics.median(e["step_s"] for e in measured)
        result["tokens_per_s"] = sum(e["tokens"] for e in measured) / sum(e["step_s"] for e in measured) * 2
        result["start"] = up.control.events(type="start", limit=4)
        result["drills"] = []
        for body in DRILLS:
            up.wait_training(timeout_s=240)
            drill = up.drill(body)
            result["drills"].append(drill)
            print(f"{body['kind']}: {drill['status']}, fingerprints equal {drill['fingerprints_equal']}", flush=True)
        result["data"] = up.control.data()
        result["heals"] = up.control.events(type="heal", limit=100)
    except Exception as err:  # noqa: BLE001  what ran so far is written, with why it stopped
        result["error"] = f"{type(err).__name__}: {err}"
        raise
    finally:
        up.stop()
        result["seconds"] = time.time() - began
        path = write_result("gpu-check", vars(args) | {"out": str(args.out)}, **result)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / path.name).write_text(path.read_text())
        print(json.dumps({k: result.get(k) for k in ("gpu", "step_s", "tokens_per_s", "seconds", "error")}))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
