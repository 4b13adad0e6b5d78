"""Tokens per second and step time of real workloads: the byte-level default and a 138M-parameter
torchtitan Llama 3 in bf16 with a BPE tokenizer and JSONL data made from local text.

    python -m bench.workloads [--shapes 2x1 2x2] [--steps 3] [--warmup 1]

Each workload runs under `ftctl up` for each shape (groups × ranks per group), one job at a time;
the rank-0 step events of every group give the median step time, and each group's tokens over the
measured steps over their wall time its tokens per second (with ``--batch-policy constant`` the
groups split one global batch: the job's rate is their sum). The CPU has no bf16 matrix unit
(AVX2 only): ``--dtype bf16`` runs there, emulated, at a fraction of fp32's speed, which the byte
model measured both ways shows. Writes bench/results/workloads-*.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import Up, write_result
from bench.local_assets import make_jsonl, make_tokenizer

WORKLOADS = {
    "bytes-fp32": ["--config=llama3_debugmodel_bytes", "--dtype=fp32"],
    "bytes-bf16": ["--config=llama3_debugmodel_bytes", "--dtype=bf16"],
    "llama3-138m-fp32": ["--config=llama3_1b_2layers", "--dtype=fp32", "--tokenizer={tokenizer}",
                         "--dataset={dataset}"],
    "llama3-138m-bf16": ["--config=llama3_1b_2layers", "--dtype=bf16", "--tokenizer={tokenizer}",
                         "--dataset={dataset}"],
}


def workload_flags(name: str | None, assets: Path | None = None) -> list[str]:
    """The trainer flags of workload ``name`` (none: the default job), its tokenizer and data
    made under ``assets`` (a new temporary folder by default)."""
    if name is None:
        return []
    assets = assets or Path(tempfile.mkdtemp(prefix="ftbench-assets-"))
    flags = WORKLOADS[name]
    if not any("{" in f for f in flags):
        return list(flags)
    tokenizer = make_tokenizer(assets / "tokenizer", vocab_size=8192, files=300)
    dataset = make_jsonl(assets / "train.jsonl", files=60, skip=300)
    return [f.format(tokenizer=tokenizer, dataset=dataset) for f in flags]


def measure(name: str, flags: list[str], groups: int, ranks: int, steps: int, warmup: int) -> dict:
    state = Path(tempfile.mkdtemp(prefix="ftbench-")) / "state"
    # a step of the 138M model in bf16 takes minutes here: the collectives, and a group waiting for a
    # quorum while another computes, must wait that long
    up = Up(state, groups, ranks, ["--checkpoint-every=1000000", "--timeout-s=1800", "--quorum-timeout-s=3600", *flags],
            join_timeout_ms=60_000)  # the first quorum waits for every group: none trains the first steps alone
    try:
        up.wait_training(timeout_s=3600)
        events = up.full_quorum_steps(groups, warmup, steps)
        start = next(e for e in up.control.events(type="start", limit=10))
    finally:
        up.stop()
    per_group = {}
    for g in range(groups):
        mine = [e for e in events if e["group"] == g][:steps]
        per_group[g] = {"steps": len(mine), "step_s": statistics.median(e["step_s"] for e in mine),
                        "tokens_per_s": sum(e["tokens"] for e in mine) / sum(e["step_s"] for e in mine)}
    return {"workload": name, "groups": groups, "ranks_per_group": ranks, "config": start["config"],
            "model": start["model"], "parameters": start["parameters"], "dtype": start["dtype"],
            "seq_len": start["seq_len"], "global_batch": start["global_batch_size"],
            "step_s": statistics.median(v["step_s"] for v in per_group.values()),
            "tokens_per_s_per_group": statistics.median(v["tokens_per_s"] for v in per_group.values()),
            "tokens_per_s": sum(v["tokens_per_s"] for v in per_group.values()), "per_group": per_group}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--shapes", nargs="+", default=["2x1", "2x2"], help="groups x ranks per group")
    parser.add_argument("--steps", type=int, default=2, help="measured steps, every group in the quorum")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out first")
    args = parser.parse_args()
    assets = Path(tempfile.mkdtemp(prefix="ftbench-assets-"))
    runs: list[dict] = []
    out = None
    for name in args.workloads:
        flags = workload_flags(name, assets)
        for shape in args.shapes:
            groups, ranks = map(int, shape.split("x"))
            r = measure(name, flags, groups, ranks, args.steps, args.warmup)
            runs.append(r)
            out = write_result("workloads", vars(args), out, runs=runs)  # each run kept as it ends
            print(f"{name} ({r['parameters'] / 1e6:.1f}M parameters, {r['dtype']}) {groups}×{ranks}: step "
                  f"{r['step_s']:.2f} s, {r['tokens_per_s_per_group']:.0f} tokens/s per group, "
                  f"{r['tokens_per_s']:.0f} in all", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
