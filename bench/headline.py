"""The README's headline table, made from the committed results: every number in it is read
from the JSON file its row links, so the table cannot drift from the measurements.

    python -m bench.headline            # print the table
    python -m bench.headline --write    # put it into README.md between its markers

``tests/unit/test_headline.py`` checks that the README holds exactly what this renders.
"""

from __future__ import annotations

import argparse
import json
import statistics as st
from pathlib import Path

from service.controlplane.goodput import Assumptions, MeasuredRecovery, heal_time_s, transfer_s

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def span(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}–{max(values):{fmt}}"


def rejoins(name: str) -> list[dict]:
    """The reports of a cold-start result's rejoins that ran to the end."""
    return [x["report"] for x in load(name)["rejoins"] if x["status"] == "done"]


def rows() -> list[tuple[str, str, str]]:
    """(what, result, the committed file it comes from), in the README's order."""
    out = []

    f = "faults-20261203T182839Z.json"
    d, s = load(f), load(f)["settings"]
    kill = [r["report"] for r in d["runs"] if r["fault"] == "kill" and r["status"] == "done"]
    v = [x["survivors_resume_s"] for x in kill]
    out.append(("Kill a replica group (SIGKILL) → the other groups commit again",
                f"{st.median(v):.2f} s median ({span(v, '.2f')} s) over {len(v)} kills, "
                f"{min(s['groups'])}–{max(s['groups'])} groups × {s['ranks_per_group']} rank", f))
    hang = [r["report"] for r in d["runs"] if r["fault"] == "hang" and r["status"] == "done"]
    v = [x["survivors_resume_s"] for x in hang]
    out.append(("Hang a group (every rank SIGSTOPped) → the watchdog ends it, the others commit again",
                f"{st.median(v):.2f} s median ({span(v, '.2f')} s) over {len(v)} hangs", f))

    f = "faults-20261203T230452Z.json"
    d = load(f)
    lh = [r["report"] for r in d["runs"] if r["fault"] == "lighthouse" and r["status"] == "done"]
    v = [x["survivors_resume_s"] for x in lh]
    out.append(("Kill the Lighthouse → it restarts, every group commits again",
                f"{st.median(v):.2f} s median ({span(v, '.2f')} s) over {len(v)} kills; "
                f"{sum(x['steps_lost'] for x in lh)} steps lost, "
                f"{sum(len(x['process_exits']) for x in lh)} group processes restarted", f))

    f = "faults-20261207T131139Z.json"
    d = load(f)
    drain, kill = ([r["report"] for r in d["runs"] if r["fault"] == fault and r["status"] == "done"]
                   for fault in ("drain", "kill"))
    v, k = [x["survivors_resume_s"] for x in drain], [x["survivors_resume_s"] for x in kill]
    out.append(("Drain a group (`ftctl drain`: it commits its step and leaves) → the others commit again",
                f"{sum(x['survivors_steps_lost'] for x in drain)} survivor steps lost over {len(drain)} drains "
                f"({sum(x['survivors_steps_lost'] for x in kill)} over {len(kill)} kills); {st.median(v):.2f} s median "
                f"({span(v, '.2f')} s) vs {st.median(k):.2f} s after a kill: the survivors still wait for its "
                "heartbeat to expire", f))

    f = "partition-20261207T162103Z.json"
    runs = load(f)["runs"]
    on = {mode: [r for r in runs if r["watch"] == "on" and r["mode"] == mode] for mode in ("cut", "isolate")}
    off = {mode: [r for r in runs if r["watch"] == "off" and r["mode"] == mode] for mode in ("cut", "isolate")}
    cut, isolate = ([r["survivors_resume_s"] for r in on[m]] for m in ("cut", "isolate"))
    inside = sum(r["where"] == "inside" for m in on for r in on[m])
    off_isolate = [r["survivors_resume_s"] for r in off["isolate"] if r["survivors_resume_s"] is not None]
    out.append(("Cut two groups' hosts apart (both still reach the Lighthouse), or one group's host off the "
                "network, no control plane → the others commit again",
                f"cut: {st.median(cut):.2f} s median ({span(cut, '.2f')} s) over {len(cut)} cuts; isolate: "
                f"{st.median(isolate):.2f} s ({span(isolate, '.2f')} s) over {len(isolate)}; {inside} of them inside "
                f"an all-reduce. With `--no-collective-watch`, a cut pair's survivors had not resumed "
                f"{load(f)['settings']['give_up_s']:g} s later in {sum(r['survivors_resume_s'] is None for r in off['cut'])}"
                f" of {len(off['cut'])} cuts, and an isolated host cost {st.median(off_isolate):.2f} s median "
                f"({span(off_isolate, '.2f')} s)", f))

    f = "slow-link-20261207T195455Z.json"
    runs = load(f)["runs"]
    at = {sync: [r for r in runs if r["sync"] == sync and r["link_mbit"] == 100] for sync in ("hsdp", "diloco")}
    out.append(("Two groups whose link is 100 Mbit/s: DiLoCo (`--sync diloco`, a sync every 20 steps) vs synchronous "
                "HSDP, throughput as a share of each mode's own on a 10 Gbit/s link",
                f"DiLoCo {at['diloco'][0]['throughput_vs_fastest_link']:.0%} "
                f"({at['diloco'][0]['tokens_per_s']:,.0f} tokens/s, {at['diloco'][0]['bytes_per_step'] / 1e6:.1f} MB "
                f"a step) vs HSDP {at['hsdp'][0]['throughput_vs_fastest_link']:.0%} "
                f"({at['hsdp'][0]['tokens_per_s']:,.0f} tokens/s, {at['hsdp'][0]['bytes_per_step'] / 1e6:.1f} MB a "
                f"step); loss after 80 steps {at['diloco'][0]['loss_at_end']:.2f} vs {at['hsdp'][0]['loss_at_end']:.2f}"
                " ([workloads.md](docs/workloads.md#slow-links-between-groups-semi-synchronous-training-diloco-localsgd))",
                f))

    f = "recovery-20261207T063628Z.json"
    d = load(f)
    ft, classic = ([r["kill_to_full_s"] for r in d[path]] for path in ("torchft", "classic"))
    out.append(("Kill a group → every group trains again: fail-over to a warm spare vs a classic torchrun restart",
                f"{st.median(ft):.2f} s vs {st.median(classic):.2f} s median ({st.median(classic) / st.median(ft):.1f}×, "
                f"{len(ft)} kills each, {d['settings']['groups']} groups × {d['settings']['ranks_per_group']} ranks)",
                f))

    out += heal_rows()

    f = "cold-start-20261204T202847Z.json"
    rj = rejoins(f)
    v = [x["rejoin_to_healed_commit_s"] for x in rj]
    out.append(("Rejoin a killed group (forked from its zygote) → first healed commit",
                f"{st.median(v):.2f} s median ({span(v, '.2f')} s); "
                f"{st.median(x['heal_bytes'] for x in rj) / 1e6:.1f} MB healed from a peer; "
                f"fingerprints equal {sum(x['fingerprints_equal'] for x in rj)} of {len(rj)}", f))

    f = "cold-start-20261204T191037Z.json"
    v = [x["rejoin_to_healed_commit_s"] for x in rejoins(f)]
    out.append(("The same rejoin as a cold torchrun start (`--no-zygote`)",
                f"{st.median(v):.2f} s median ({span(v, '.2f')} s)", f))

    f = "checkpoint-20261205T074522Z.json"
    d = load(f)
    n = sum(len(t["stall_s"]) for t in d["turns"] if t["asynchronous"])
    out.append(("Step stall for a checkpoint, written off the step vs synchronously",
                f"{d['stall_async_s']:.3f} s vs {d['stall_sync_s']:.2f} s median ({n} saves each)", f))

    f = "overhead-20261204T151803Z.json"
    d = load(f)
    s = d["settings"]
    out.append(("Median step: torchft HSDP with the gradient check vs plain FSDP2 HSDP without torchft",
                f"{d['check_step_s']:.3f} s vs {d['classic_step_s']:.3f} s "
                f"({s['groups']} groups × {s['ranks_per_group']} ranks)", f))

    f = "overhead-20261207T100120Z.json"
    d = load(f)
    s = d["settings"]
    out.append((f"The same at Llama 3 138M, fp32 ({s['groups']} groups × {s['ranks_per_group']} rank)",
                f"{d['check_step_s']:.2f} s (check on), {d['no_check_step_s']:.2f} s (off) vs {d['classic_step_s']:.2f} s: "
                f"torchft costs {d['check_step_s'] / d['classic_step_s'] - 1:+.0%} / "
                f"{d['no_check_step_s'] / d['classic_step_s'] - 1:+.0%} ([faults.md](docs/faults.md#cost-of-the-check-and-of-torchft))",
                f))

    f = "chaos-20261204T210114Z.json"
    c = load(f)["chaos"]["report"]
    out.append((f"Goodput with a random kill every {c['mtbf_s']:.0f} s on average (warm spares, fail-over)",
                f"{c['goodput'] * 100:.1f}% over {len(c['kills'])} kills in {c['duration_s']:.0f} s", f))

    f = "ingest-20261206T024038Z.json"
    d = load(f)
    x = max(d["runs"], key=lambda r: r["groups"])
    out.append((f"Control plane at {x['groups']:,} groups: ingest lag p99, `GET /groups` p99",
                f"{x['ingest_lag_s']['p99']:.2f} s, {x['api_groups_s']['p99'] * 1000:.0f} ms "
                f"({x['events_per_s']:,.0f} events/s, {x['metrics_series']:,} series)", f))

    f = "workloads-20261207T050806Z.json"
    d = load(f)
    x = next(r for r in d["runs"] if r["config"] == "llama3_debugmodel_bytes" and r["dtype"] == "fp32"
             and r["ranks_per_group"] == 1)
    out.append((f"Training throughput, default model ({x['parameters'] / 1e6:.1f}M parameters, {x['dtype']}), "
                f"{x['groups']} groups × {x['ranks_per_group']} rank",
                f"{x['tokens_per_s']:,.0f} tokens/s in all, {x['step_s']:.2f} s a step", f))
    return out



def _heal(runs: list[dict], way: str, in_place: bool, sources: int = 1, state_gb: float | None = None) -> dict:
    return next(r for r in runs if r["way"] == way and r["in_place"] == in_place and r["sources"] == sources
                and (state_gb is None or r["state_gb"] == state_gb))


def heal_rows() -> list[tuple[str, str, str]]:
    """The heal transport alone (loopback, and links shaped as between hosts), and a rejoin at a
    state over a GiB phase by phase, projected to 8B parameters on 8 GPUs a group."""
    out = []
    f = HEAL_LOOPBACK
    runs = load(f)["runs"]
    fresh, raw, torchft = (_heal(runs, w, False, state_gb=2.0) for w in ("stream", "raw-tcp", "torchft-http"))
    in_place, raw_in_place = (_heal(runs, w, True, state_gb=2.0) for w in ("stream", "raw-tcp"))
    out.append(("Heal a 2 GiB state (loopback, one source): this transport vs a raw TCP copy of the same tensors",
                f"{in_place['gib_per_s']:.2f} vs {raw_in_place['gib_per_s']:.2f} GiB/s ({in_place['of_raw_tcp']:.0%}) "
                f"in place, as a trainer's heal lands; {fresh['gib_per_s']:.2f} vs {raw['gib_per_s']:.2f} GiB/s "
                f"({fresh['of_raw_tcp']:.0%}) into fresh memory, where torchft's pickling transport made "
                f"{torchft['gib_per_s']:.2f}; peak memory "
                f"+{max(r['extra_of_state'] for r in runs if r['way'] == 'stream'):.0%} of the state", f))
    f = HEAL_LINK
    d = load(f)
    streams = sorted((r for r in d["runs"] if r["way"] == "stream"), key=lambda r: r["sources"])
    out.append((f"Heal striped over live peers, each peer's link shaped to {d['settings']['link_mbit']} Mbit/s",
                ", ".join(f"{r['sources']} source{'s' if r['sources'] > 1 else ''}: {r['gib_per_s'] * 2**30 / 1e6:.0f} MB/s"
                          + (f" ({r['of_one_source']:.2f}×)" if r["sources"] > 1 else "") for r in streams), f))
    f = RECOVERY_LARGE
    d = load(f)
    runs, s = d["torchft"], d["settings"]
    phases = {p["phase"]: p for p in runs[0]["recovery"]}
    seconds = {name: st.median(next(p["seconds"] for p in r["recovery"] if p["phase"] == name) for r in runs)
               for name in phases}
    rejoin = [r["rejoin_to_healed_commit_s"] for r in runs]
    heal = st.median(r["heal_bytes"] for r in runs)
    shown = [name for name in phases if phases[name]["within"] is None and seconds[name] >= 0.1]
    out.append((f"Rejoin a killed group holding {heal / 1e9:.1f} GB ({s['workload']}, {s['groups']} groups × "
                f"{s['ranks_per_group']} rank) → first healed commit, phase by phase (medians, s)",
                f"{st.median(rejoin):.2f} s median ({span(rejoin, '.2f')} s): "
                + ", ".join(f"{phases[n]['label']} {seconds[n]:.2f}" for n in shown)
                + f"; the transfer at {heal / 2**30 / seconds['transfer']:.2f} GiB/s", f))
    projected = heal_time_s(measured_from(runs), Assumptions(state_gb_per_rank=12, heal_gb_per_s=25))
    out.append(("The same rejoin with 8B parameters on 8 GPUs a group (12 GB a rank) at 25 GB/s "
                "(`GET /api/v1/goodput?state_gb_per_rank=12&heal_gb_per_s=25`)",
                f"{projected:.1f} s: this machine's other phases (its CPU's model build and steps) and 12 GB at "
                "25 GB/s; torchft #329 measured 948 s from a fault to full recovery", f))
    return out


def measured_from(runs: list[dict]) -> MeasuredRecovery:
    """What the control plane's goodput projection reads from its drills, from a bench.recovery run."""
    median = lambda key: st.median(r[key] for r in runs)  # noqa: E731
    return MeasuredRecovery(drills=len(runs), detect_s=median("detect_s"),
                            reconfigure_s=st.median(r["survivors_resume_s"] - r["detect_s"] for r in runs),
                            rejoin_to_healed_commit_s=median("rejoin_to_healed_commit_s"),
                            heal_transfer_s=st.median(transfer_s(r) for r in runs), heal_bytes=median("heal_bytes"),
                            survivor_steps_lost=median("steps_lost"), step_s=None)


HEAL_LOOPBACK = "heal-20261207T092605Z.json"
HEAL_LINK = "heal-20261207T091835Z.json"
RECOVERY_LARGE = "recovery-20261207T093925Z.json"


def table() -> str:
    lines = ["| what | result | source |", "|---|---|---|"]
    lines += [f"| {what} | {result} | [{name}](bench/results/{name}) |" for what, result, name in rows()]
    return "\n".join(lines)


def readme_table(readme: str) -> str:
    """The table the README holds between its markers."""
    return readme.split(START, 1)[1].split(END, 1)[0].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the README's table with this one")
    args = parser.parse_args()
    if not args.write:
        print(table())
        return
    path = REPO / "README.md"
    readme = path.read_text()
    path.write_text(readme.replace(readme_table(readme), table()))


if __name__ == "__main__":
    main()
