"""The control plane's side of many groups, alone: ingest, the API and the metrics at 1,000 groups.

    python -m bench.ingest --groups 1000 [--steps-per-s 5] [--post-interval-s 0.5] [--duration 30]

``bench.scale`` runs simulated groups through the real Lighthouse, whose quorum costs about N²
and takes this machine's two cores well before 1,000 groups. This bench keeps the real control
plane (its HTTP server, validation, SQLite, metrics, straggler detector, liveness) and replaces
the groups with one load process that speaks the agents' protocols as N agents would: each group
registers (``protocol/registration.py``) with its own token, then sends its events on its stream
(``protocol/ingest.py``; ``--post`` POSTs them instead) every ``--post-interval-s``: one
committed step event per step at
``--steps-per-s``, and a quorum event whenever the simulated quorum changes. It answers the
agent API's status for every group, so the control plane's liveness checks find them there.

While it runs, the bench reads ``GET /groups`` and ``/quorum`` every ``--poll-s`` (as
the page does every second) and ``/metrics`` every ``--scrape-every-s`` (as Prometheus does,
every 15 s by default there), and reports:

- ingest lag p50/p99, from an event's timestamp to its row in SQLite (it includes the wait in the
  agent until its next post: at most ``--post-interval-s``);
- the batches the control plane answered, refused as overloaded (503) and failed, and the time to
  each answer;
- latency of ``/groups`` and ``/quorum``; size, series and time of ``/metrics``;
- the control plane's CPU and resident memory, and the load process's CPU;
- with ``--page``, after the window and under the same load: the time until Chromium shows every
  group on the page.

Writes bench/results/ingest-*.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import psutil
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from websockets.asyncio.client import connect as ws_connect

from bench.events import start_fields, step_fields
from bench.common import TOKEN, write_result
from bench.scale import (API_READS, cpu_cores, cpu_seconds, fmt, ingest_lag, measure_each, page_seconds, series_count,
                         summary, timed_get)
from bench.simulated import SimJob, SimShape, parse_groups
from protocol import api
from protocol.agent import HEALTH_PATH, STATUS_PATH, AgentStatus
from protocol.events import ProcessEvent, QuorumEvent, StartEvent, StepEvent
from protocol.health import Served
from protocol.ingest import IngestResult, StreamAnswer, ingest_path, ingest_stream_path
from protocol.registration import CHALLENGE_PATH, AgentRegistration, ChallengeAnswer, agent_path
from protocol.tokens import group_token
from protocol.torchrun import free_port


class LoadStats(BaseModel):
    batches: int = 0
    overloaded: int = 0
    failed: int = 0
    events: int = 0
    answer_s: list[float] = []


class Load:
    """N agents' batches from one process: each group's events as its agent would forward them."""

    def __init__(self, groups: list[int], control_plane: str, job_token: str, url: str, steps_per_s: float,
                 post_interval_s: float, quorum_every_steps: int, post: bool):
        self.groups = groups
        self.control_plane = control_plane
        self.job_token = job_token
        self.url = url
        self.steps_per_s = steps_per_s
        self.post_interval_s = post_interval_s
        self.quorum_every_steps = quorum_every_steps
        self.post = post
        self.stats = LoadStats()

    def take(self, reset: bool) -> LoadStats:
        out = self.stats.model_copy(deep=True)
        if reset:
            self.stats = LoadStats()
        return out

    def _events(self, group: int, first: int, last: int, began: float) -> list[dict]:
        """Steps ``first..last`` of one group, stamped when each was due, with a quorum change
        every ``quorum_every_steps``."""
        out = []
        for step in range(first, last + 1):
            ts = began + step / self.steps_per_s
            quorum_id = step // self.quorum_every_steps
            if step % self.quorum_every_steps == 0:
                out.append(QuorumEvent(group=group, rank=0, ts=ts, eid=f"load-{group}-q{step}", quorum_id=quorum_id,
                                       previous_quorum_id=quorum_id - 1, step=step,
                                       participants=len(self.groups)).model_dump(mode="json"))
            out.append(StepEvent(group=group, rank=0, ts=ts, eid=f"load-{group}-s{step}", **step_fields(
                step, len(self.groups), loss=1.0 / step, step_s=1 / self.steps_per_s,
                compute_s=0.8 / self.steps_per_s * random.uniform(0.95, 1.05), allreduce_s=0.1 / self.steps_per_s,
                commit_s=0.001, quorum_id=quorum_id, batches_committed=step)).model_dump(mode="json"))
        return out

    @staticmethod
    def _start(group: int, ts: float) -> list[dict]:
        """What an agent's start of its group and the group's rank 0 say first."""
        return [e.model_dump(mode="json") for e in (
            ProcessEvent(group=group, ts=ts, eid=f"load-{group}-p", action="started", pid=os.getpid()),
                StartEvent(group=group, rank=0, ts=ts, eid=f"load-{group}-start", **start_fields(
                    pid=os.getpid(), replica_id=f"load_{group}:0", device="simulated")))]

    async def _agent(self, group: int) -> None:
        async with httpx.AsyncClient(base_url=self.control_plane, timeout=30) as client:
            await self._forward(client, group)

    async def _send(self, client: httpx.AsyncClient, stream, group: int, headers: dict,
                    events: list[dict]) -> tuple[int, IngestResult | None]:
        """The answer to one batch, on the stream or by POST."""
        if stream is None:
            response = await client.post(ingest_path(group), json={"events": events}, headers=headers)
            ok = response.status_code == 200
            return response.status_code, IngestResult.model_validate_json(response.content) if ok else None
        await stream.send(json.dumps({"events": events}))
        answer = StreamAnswer.model_validate_json(await stream.recv())
        return answer.status, answer.result

    async def _forward(self, client: httpx.AsyncClient, group: int) -> None:
        """One agent: its own connection, as each agent has (httpx's pool scans every connection per
        request: one pool for a thousand agents would cost more than the control plane)."""
        headers = {"Authorization": f"Bearer {group_token(self.job_token, group)}"}
        registration = AgentRegistration(url=f"{self.url}/g/{group}", ranks_per_group=1).model_dump(mode="json")
        while True:
            try:
                (await client.put(agent_path(group), json=registration, headers=headers)).raise_for_status()
                break
            except httpx.HTTPError:
                await asyncio.sleep(1)
        await asyncio.sleep(random.uniform(0, self.post_interval_s))  # agents started at different times
        async with AsyncExitStack() as stack:
            stream = None if self.post else await stack.enter_async_context(ws_connect(
                self.control_plane.replace("http", "ws", 1) + ingest_stream_path(group), additional_headers=headers,
                compression=None))
            began, sent, paced_s = time.time(), 0, 0.0
            pending = self._start(group, began)
            while True:
                due = int((time.time() - began) * self.steps_per_s)
                if due > sent:
                    pending += self._events(group, sent + 1, due, began)
                    sent = due
                if pending:
                    posted = time.perf_counter()
                    status, result = await self._send(client, stream, group, headers, pending)
                    paced_s = (result.send_every_s or 0.0) if result else paced_s
                    if status == 503:
                        self.stats.overloaded += 1
                    elif status != 200:
                        self.stats.failed += 1
                    else:
                        self.stats.batches += 1
                        self.stats.events += len(pending)
                        self.stats.answer_s.append(time.perf_counter() - posted)
                        pending = []
                await asyncio.sleep(max(self.post_interval_s, paced_s))  # as the agent's forwarder does

    async def run(self) -> None:
        await asyncio.gather(*(self._agent(g) for g in self.groups))


def create_app(load: Load) -> FastAPI:
    app = FastAPI(title="ingest load")

    @app.get("/g/{group}" + STATUS_PATH, response_model=AgentStatus)
    async def status(group: int) -> AgentStatus:
        if group not in load.groups:
            raise HTTPException(404, f"no group {group} here")
        return AgentStatus(group=group, state="running", pid=os.getpid(), pids=[os.getpid()], starts=1, restarts=0,
                           last_step=None, last_exit=None, events_buffered=0, events_dropped=0,
                           events_forwarded=0, control_plane_reachable=True)

    @app.get("/g/{group}" + HEALTH_PATH, response_model=Served)
    async def healthz(group: int) -> Served:
        return Served(ok=True)

    @app.get("/g/{group}" + CHALLENGE_PATH, response_model=ChallengeAnswer)
    async def challenge(group: int, nonce: str) -> ChallengeAnswer:
        """As an agent proves its registration (``protocol/registration.py``)."""
        return ChallengeAnswer.of(group_token(load.job_token, group), group, f"{load.url}/g/{group}", nonce)

    @app.get("/stats", response_model=LoadStats)
    async def stats(reset: bool = False) -> LoadStats:
        return load.take(reset)

    return app


async def serve_load(args: argparse.Namespace) -> None:
    listener = socket.create_server(("127.0.0.1", args.port))
    load = Load(args.load, args.control_plane, os.environ["FTCTL_TOKEN"], f"http://127.0.0.1:{args.port}",
                args.steps_per_s, args.post_interval_s, args.quorum_every_steps, args.post)
    server = uvicorn.Server(uvicorn.Config(create_app(load), log_level="warning"))
    await asyncio.gather(server.serve(sockets=[listener]), load.run())


def measure(args: argparse.Namespace, groups: int) -> dict:
    state = Path(tempfile.mkdtemp(prefix=f"ftbench-ingest-{groups}-"))
    with SimJob(state, SimShape(groups=groups, hosts=0), TOKEN, ["--max-groups", str(max(groups, 4096))]) as job:
        port = free_port()
        job.spawn("load", ["-m", "bench.ingest", "--load", f"0-{groups - 1}", "--control-plane", job.api_url,
                           "--port", str(port), "--steps-per-s", str(args.steps_per_s),
                           "--post-interval-s", str(args.post_interval_s),
                           "--quorum-every-steps", str(args.quorum_every_steps), *(["--post"] if args.post else [])])
        load_url = f"http://127.0.0.1:{port}"
        job.wait_http("load", f"{load_url}/stats")
        ready_s = job.wait_training(args.ready_timeout_s)
        time.sleep(args.settle_s)
        httpx.get(f"{load_url}/stats", params={"reset": True}, timeout=30)
        cpu_before, began, since = cpu_seconds(job), time.monotonic(), time.time()
        reads: dict[str, list[float]] = {name: [] for name in API_READS}
        metrics: list[tuple[float, int]] = []
        rss = []
        control_plane = psutil.Process(job.procs["controlplane"].pid)
        scraped = 0.0
        while (now := time.monotonic()) - began < args.duration:
            for name, path in API_READS.items():
                reads[name].append(timed_get(job, api.url(path))[0])
            if now - scraped >= args.scrape_every_s:
                seconds, body = timed_get(job, "/metrics")
                metrics.append((seconds, len(body)))
                scraped = now
            rss.append(control_plane.memory_info().rss)
            time.sleep(args.poll_s)
        window = time.monotonic() - began
        cpu_after = cpu_seconds(job)
        page_s = page_seconds(job, groups) if args.page else None
        load = LoadStats.model_validate(httpx.get(f"{load_url}/stats", timeout=30).json())
        lag = ingest_lag(state / "control.db", since)
    return {
        "groups": groups, "ready_s": ready_s, "window_s": window,
        "events_per_s": load.events / window, "batches_per_s": load.batches / window,
        "overloaded": load.overloaded, "failed": load.failed, "answer_s": summary(load.answer_s),
        "ingest_lag_s": summary(lag),
        "api_groups_s": summary(reads["groups"]), "api_quorum_s": summary(reads["quorum"]),
        "metrics_s": summary([m[0] for m in metrics]), "metrics_bytes": metrics[-1][1] if metrics else None,
        "metrics_series": series_count(body), "control_plane_rss_bytes": max(rss) if rss else None, "page_s": page_s,
        "cpu_cores": cpu_cores(cpu_before, cpu_after, window),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[1000])
    parser.add_argument("--steps-per-s", type=float, default=5.0, help="each group's training steps per second")
    parser.add_argument("--post-interval-s", type=float, default=0.2,
                        help="each agent's shipping interval (the agent's --forward-interval-s); the control plane "
                        "may ask for a longer one")
    parser.add_argument("--quorum-every-steps", type=int, default=50, help="a new quorum every this many steps")
    parser.add_argument("--post", action="store_true", help="POST each batch instead of sending it on a stream")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured, after every group trains")
    parser.add_argument("--poll-s", type=float, default=1.0, help="how often the API is read")
    parser.add_argument("--scrape-every-s", type=float, default=5.0, help="how often /metrics is read")
    parser.add_argument("--page", action="store_true", help="after the window: the page's load time in Chromium")
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--ready-timeout-s", type=float, default=120.0)
    parser.add_argument("--load", type=parse_groups, help=argparse.SUPPRESS)
    parser.add_argument("--control-plane", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:  # the load process bench.ingest starts
        asyncio.run(serve_load(args))
        return
    print(f"{'groups':>6} {'events/s':>9} {'batches/s':>9} {'503':>5} {'answer ms':>10} {'ingest lag ms':>14} "
          f"{'/groups ms':>11} {'/quorum ms':>11} {'/metrics':>20} {'RSS MB':>7} {'page s':>7}  cpu cores", flush=True)

    def row(r: dict) -> str:
        return (f"{r['events_per_s']:>9.0f} {r['batches_per_s']:>9.0f} {r['overloaded']:>5} {fmt(r['answer_s']):>10} "
                f"{fmt(r['ingest_lag_s']):>14} {fmt(r['api_groups_s']):>11} {fmt(r['api_quorum_s']):>11} "
                f"{r['metrics_series']:>6} series {fmt(r['metrics_s'])} ms {r['control_plane_rss_bytes'] / 2**20:>7.0f} "
                f"{'-' if r['page_s'] is None else format(r['page_s'], '.2f'):>7}")

    runs = measure_each(args, measure, row)
    out = write_result("ingest", {k: v for k, v in vars(args).items() if k not in ("load", "control_plane", "port")},
                       runs=runs)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
