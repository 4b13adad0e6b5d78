"""Metrics, Prometheus rules, the dashboard as code, and the page's assets (no live job needed)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess

import pytest
from fastapi.testclient import TestClient
from prometheus_client import Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster import REPO
from dashboards.quorum import OUTPUT, panel_queries, render
from protocol import api as paths
from service.controlplane.app import create_app
from service.controlplane.exposition import exposition
from service.controlplane.metrics import JobMetrics
from test_controlplane_api import T0, heal, ingest, process, scrape, settings, start, step, trainer_event

PROM = REPO / "deploy/prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    if not shutil.which("promtool"):
        pytest.fail("promtool is not installed: .ci/run installs Debian's prometheus package")
    return subprocess.run(["promtool", *args], cwd=PROM, capture_output=True, text=True, timeout=120)


@pytest.mark.prometheus
def test_prometheus_config_and_rules_check_and_their_unit_tests_pass():
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "rules.yml"), ("test", "rules", "rules_test.yml")):
        result = promtool(*args)
        assert result.returncode == 0, result.stdout + result.stderr
    alerts = re.findall(r"alert: (\w+)", (PROM / "rules.yml").read_text())
    tested = set(re.findall(r"alertname: (\w+)", (PROM / "rules_test.yml").read_text()))
    assert set(alerts) == tested, f"alerts without a promtool test: {set(alerts) - tested}"


def test_committed_dashboard_is_exactly_what_the_code_generates():
    assert OUTPUT.read_text() == render(), "dashboards/quorum.json is stale: run python -m dashboards.quorum"
    dash = json.loads(OUTPUT.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(t["refId"] for p in dash["panels"] for t in p["targets"])
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "group"}
    assert {a["name"] for a in dash["annotations"]["list"]} == {"Kills", "Rejoins", "Heals", "Gradient check"}
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for needed in ("quorum id", "participants", "step per group", "lag", "group state", "compute vs waiting", "loss",
                   "heals", "failed commits", "drill", "goodput", "gradient check"):
        assert needed in titles, needed
    assert all("ftctl_" in expr for _, _, expr in panel_queries(dash))


def test_metrics_follow_the_events(tmp_path):
    with TestClient(create_app(settings(tmp_path / "control.db"))) as api:
        ingest(api, 0, [process(0, "started", T0), start(0, T0 + 1), step(0, T0 + 2, 1), step(0, T0 + 3, 2),
                        trainer_event("fingerprint", 0, T0 + 3, step=2, digest="aa"),
                        trainer_event("checkpoint", 0, T0 + 3, action="saved", step=2, seconds=0.4, path="x")])
        ingest(api, 1, [process(1, "started", T0), heal(1, T0 + 2, 1), step(1, T0 + 3, 2),
                        step(1, T0 + 3.5, 2, committed=False),
                        trainer_event("commit_failed", 1, T0 + 3.5, step=2, quorum_id=1),
                        trainer_event("fingerprint", 1, T0 + 3, step=2, digest="aa"),
                        process(1, "killed", T0 + 4)], dropped=7)
        m = scrape(api)
        assert m[("ftctl_group_state", (("group", "1"), ("state", "down")))] == 1
        assert m[("ftctl_group_state", (("group", "0"), ("state", "training")))] == 1
        assert m[("ftctl_group_state_code", (("group", "1"),))] == 5
        assert m[("ftctl_group_up", (("group", "1"),))] == 0 and m[("ftctl_group_up", (("group", "0"),))] == 1
        assert m[("ftctl_commits_total", (("group", "0"),))] == 2
        assert m[("ftctl_commit_failures_total", (("group", "1"),))] == 1
        assert m[("ftctl_heals_total", (("group", "1"),))] == 1 and m[("ftctl_heal_bytes_total", (("group", "1"),))] == 1000
        assert m[("ftctl_group_exits_total", (("group", "1"), ("reason", "killed")))] == 1
        assert m[("ftctl_events_dropped_total", (("group", "1"),))] == 7
        assert m[("ftctl_fingerprint_mismatch", ())] == 0
        assert m[("ftctl_checkpoint_last_save_timestamp_seconds", ())] == T0 + 3
        assert m[("ftctl_step_compute_seconds_count", (("group", "0"),))] == 2
        ingest(api, 0, [trainer_event("fingerprint", 0, T0 + 5, step=3, digest="aa")])
        ingest(api, 1, [trainer_event("fingerprint", 1, T0 + 5, step=3, digest="bb")])
        assert scrape(api)[("ftctl_fingerprint_mismatch", ())] == 1
        names = {name for name, _ in scrape(api)}
        assert all(n.startswith("ftctl_") for n in names if not n.startswith(("python_", "process_")))


def test_a_groups_return_is_timed_phase_by_phase(tmp_path):
    """Restart at T0, up at T0+6 (stages of 1 s each, no checkpoint), quorum at +6.5, torchft
    calls the transport at +6.6, header 0.1 s, transfer 2 s (0.25 s of checksums), applied at
    +9.5 after 0.4 s, first commit at +9.9."""
    timed = dict(step=4, source_group=0, sources=[0, 2], bytes=2**30, quorum_at=T0 + 6.5, fetch_started_at=T0 + 6.6,
                 header_s=0.1, transfer_s=2.0, checksum_s=0.25, fetch_s=2.1, load_s=0.4, applied_at=T0 + 9.5)
    with TestClient(create_app(settings(tmp_path / "control.db"))) as api:
        ingest(api, 1, [process(1, "started", T0), start(1, T0 + 6), trainer_event("heal", 1, T0 + 9.8, **timed),
                        step(1, T0 + 9.9, 4), step(1, T0 + 10.4, 5)])
        m = scrape(api)
    phase = lambda name, what: m[(f"ftctl_heal_phase_seconds_{what}", (("phase", name),))]  # noqa: E731
    seconds = {"process_start": 2.0, "manager": 1.0, "quorum_wait": 0.5, "metadata": 0.2, "transfer": 2.0,
               "verify": 0.25, "healing_step": 0.4, "apply": 0.4, "first_commit": 0.4}
    for name, expected in seconds.items():
        assert (phase(name, "count"), phase(name, "sum")) == (1, pytest.approx(expected)), name


def test_page_and_assets_are_served_locally_with_no_internet_references(tmp_path):
    with TestClient(create_app(settings(tmp_path / "control.db"))) as api:
        page = api.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text):
            body = api.get(asset)
            assert body.status_code == 200, asset
            assert not re.search(r"https?://", body.text), f"{asset} refers to the internet"
        assert not re.search(r"https?://", page.text)
        assert api.post(paths.url(paths.GROUP_KILL, group=0)).status_code == 401, "the page's actions need the token"


def test_known_label_values_are_there_at_zero_before_anything_happens(tmp_path):
    """increase() in an alert or a panel sees the first kill as 0 → 1, not as a new series."""
    with TestClient(create_app(settings(tmp_path / "control.db"))) as api:
        m = scrape(api)
        families = list(text_string_to_metric_families(api.get("/metrics").text))
    for g in ("0", "1"):
        for reason in ("killed", "crashed", "drained", "finished"):
            assert m[("ftctl_group_exits_total", (("group", g), ("reason", reason)))] == 0
        for name in ("ftctl_commits_total", "ftctl_commit_failures_total", "ftctl_heals_total",
                     "ftctl_group_starts_total", "ftctl_events_dropped_total"):
            assert m[(name, (("group", g),))] == 0, name
    for kind in ("kill-heal", "hang", "lighthouse", "chaos"):
        for status in ("done", "failed"):
            assert m[("ftctl_drills_total", (("kind", kind), ("status", status)))] == 0
    for fault in ("crash", "hang", "lighthouse", "partition"):
        for name in ("ftctl_fault_detect_seconds", "ftctl_fault_resume_seconds"):
            assert math.isnan(m[(name, (("fault", fault),))]), (name, fault)
    counters = [f for f in families if f.type == "counter"]
    assert counters and all(s.name.endswith(("_total", "_created")) for f in counters for s in f.samples)
    assert not any(name == "ftctl_quorum_id" for name, _ in m), "the quorum id has one name: ftctl_lighthouse_quorum_id"


def group_series(api: TestClient, group: str) -> list[tuple[str, tuple]]:
    return [(name, labels) for name, labels in scrape(api) if ("group", group) in labels]


def test_a_group_costs_the_number_of_series_the_docs_state(tmp_path):
    """What a thousand groups put on /metrics is bounded per group: 35 series before it reports,
    43 once it trains a straggler window (its step, lag, loss, participants, quorum, the
    detector's three ratios)."""
    with TestClient(create_app(settings(tmp_path / "control.db"))) as api:
        before = group_series(api, "1")
        for g in (0, 1):
            ingest(api, g, [start(g, T0)])
        for n in range(1, 12):  # the detector judges when a full window of both is in
            for g in (0, 1):
                ingest(api, g, [step(g, T0 + n, n)])
        after = group_series(api, "1")
    assert (len(before), len(after)) == (35, 43), sorted(set(after) - set(before))
    docs = (REPO / "docs" / "observability.md").read_text()
    assert "43 series" in docs and "35 before it reports" in docs


def _samples(text: str) -> list[tuple]:
    return sorted((s.name, tuple(sorted(s.labels.items())), repr(s.value))
                  for f in text_string_to_metric_families(text) for s in f.samples)


def _render(families, slice_s: float = 0.005) -> tuple[bytes, int]:
    """The text, and how many times another coroutine ran while it was written."""
    async def run() -> tuple[bytes, int]:
        ticks, done = 0, asyncio.Event()

        async def tick() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        text = b"".join([chunk async for chunk in exposition(families, slice_s)])
        done.set()
        await ticker
        return text, ticks
    return asyncio.run(run())


def test_metrics_text_is_what_prometheus_client_writes_and_the_loop_runs_meanwhile():
    """/metrics is written by our lean writer a slice at a time; Prometheus must read the same
    samples as from prometheus-client's own writer, odd label values and non-finite values included."""
    metrics = JobMetrics(range(1000))
    for g in range(1000):
        metrics.compute.labels(str(g)).observe(0.125 * g)
        metrics.commits.labels(str(g)).inc(g)
    metrics.grad_norm.labels("3").set(math.nan)
    metrics.grad_norm.labels("4").set(math.inf)
    metrics.grad_norm.labels("5").set(-2.5e9)
    metrics.heal_seconds.observe(0.3)
    odd = Gauge("ftctl_odd", "a help with a \\ and\na newline", ["name"], registry=metrics.registry)
    odd.labels('a "quoted"\\ value\nover two lines').set(1234567.0)
    ours, ticks = _render(metrics.registry.collect(), slice_s=0.001)
    theirs = generate_latest(metrics.registry)
    assert _samples(ours.decode()) == _samples(theirs.decode())
    assert ours.count(b"\n# HELP ") == theirs.count(b"\n# HELP ") and ours.count(b"# TYPE") == theirs.count(b"# TYPE")
    assert ticks > 3, "the event loop did not run while a thousand groups' series were written"
