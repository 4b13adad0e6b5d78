"""The agent's event forwarder against a real control-plane process: nothing written is lost
across agent restarts or control-plane outages, nothing is stored twice, and a refused batch is
dropped and counted instead of being sent forever."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from cluster import REPO, wait_for
from processes import Owner
from bench.events import step_fields
from protocol.layout import GroupLayout
from protocol.events import EventIds, StepEvent
from protocol.files import read_model, write_model
from protocol.ingest import ingest_path
from protocol.torchrun import free_port
from service import client
from service.agent.forwarder import EventForwarder, Shipped, shipped_file

TOKEN = "forwarding-test-token-0123456789"


class ControlPlane:
    """``python -m service.controlplane`` for one group, which can be stopped and started again."""

    def __init__(self, tmp: Path, owner: Owner):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "service.controlplane", "--port", str(self.port), "--groups", "1",
                     "--db", str(tmp / "control.db"), "--token", TOKEN, "--lighthouse-api", f"http://127.0.0.1:{free_port()}"]
        self.log = tmp / "controlplane.log"
        self.owner = owner
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.owner.env(), stdout=out, stderr=subprocess.STDOUT)
        wait_for(self._answers, 30, "the control plane to answer")

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def events(self, **query) -> list[dict]:
        """Stored events, through the API (a client each time: the process may have been restarted)."""
        with client.ControlPlane.at(self.url, TOKEN) as api:
            return api.events(limit=1000, **query)

    def steps(self) -> list[int]:
        return [e["step"] for e in self.events(type="step")]

    def batches(self) -> dict[str, float]:
        """How the agents' batches came in since this control plane started: on a stream, by POST."""
        metrics = httpx.get(f"{self.url}/metrics").text
        return {t: float(re.search(rf'ftctl_ingest_batches_total{{transport="{t}"}} (\S+)', metrics).group(1))
                for t in ("stream", "post")}

    def types(self) -> list[str]:
        return [e["type"] for e in self.events()]


@pytest.fixture
def control_plane(tmp_path) -> Iterator[ControlPlane]:
    with Owner() as owner:
        cp = ControlPlane(tmp_path, owner)
        cp.start()
        yield cp


class Rank:
    """Appends step events to rank 0's file, as the trainer's sink does."""

    def __init__(self, events_dir: Path):
        events_dir.mkdir(parents=True, exist_ok=True)
        self.path = events_dir / GroupLayout(0).rank_events(0)
        self.ids = EventIds("g0.r0")

    def steps(self, *numbers: int) -> None:
        with open(self.path, "a") as out:
            for n in numbers:
                out.write(StepEvent(ts=time.time(), group=0, rank=0, eid=self.ids.next(), **step_fields(n))
                          .model_dump_json() + "\n")


@contextmanager
def agent(events_dir: Path, url: str, token: str = TOKEN) -> Iterator[EventForwarder]:
    forwarder = EventForwarder(0, events_dir, url, token, capacity=100, interval_s=0.05, batch=4, timeout_s=2)
    forwarder.start()
    try:
        yield forwarder
    finally:
        forwarder.stop()


def test_events_written_while_no_agent_ran_or_read_but_not_shipped_reach_the_store_once(control_plane, tmp_path):
    events = tmp_path / "events"
    rank = Rank(events)
    with agent(events, control_plane.url) as a:
        rank.steps(1, 2, 3)
        wait_for(lambda: control_plane.steps() == [1, 2, 3], 20, "steps 1-3 stored")
        a.emit_process("started", pid=1234)
        wait_for(lambda: "process" in control_plane.types(), 20, "the agent's own event stored")
    rank.steps(4, 5)  # no agent runs
    control_plane.stop()
    with agent(events, control_plane.url) as b:
        rank.steps(6, 7)
        wait_for(lambda: len(b.buffer) == 4, 20, "steps 4-7 read while the control plane is away")
        assert not b.reachable
    control_plane.start()
    with agent(events, control_plane.url) as c:
        wait_for(lambda: control_plane.steps() == [1, 2, 3, 4, 5, 6, 7], 20, "every step stored, in order")
        assert (c.dropped, c.refused) == (0, 0)
    assert control_plane.types().count("process") == 1
    batches = control_plane.batches()
    assert batches["stream"] >= 1 and batches["post"] == 0, "the agent reopened its stream after the outage"


def test_a_batch_sent_again_after_its_answer_was_lost_is_stored_once(control_plane, tmp_path):
    """The agent died after the store committed and before it recorded the offsets: the next
    agent sends the same lines again, with the same event ids."""
    events = tmp_path / "events"
    rank = Rank(events)
    with agent(events, control_plane.url):
        rank.steps(1, 2, 3)
        wait_for(lambda: control_plane.steps() == [1, 2, 3], 20, "steps 1-3 stored")
    write_model(shipped_file(events, 0), Shipped(offsets={GroupLayout(0).rank_events(0): 0}))
    rank.steps(4)
    with agent(events, control_plane.url):
        wait_for(lambda: 4 in control_plane.steps(), 20, "step 4 stored")
        time.sleep(0.3)
    assert control_plane.steps() == [1, 2, 3, 4]
    metrics = httpx.get(f"{control_plane.url}/metrics").text
    assert 'ftctl_events_duplicate_total{group="0"} 3.0' in metrics


def test_a_refused_batch_is_dropped_counted_and_said_once_not_sent_forever(control_plane, tmp_path, caplog):
    events = tmp_path / "events"
    rank = Rank(events)
    with caplog.at_level(logging.WARNING, logger="agent.forwarder"), agent(events, control_plane.url, "a-wrong-token") as a:
        rank.steps(1, 2, 3, 4, 5)
        wait_for(lambda: a.refused == 5 and not a.buffer, 20, "the refused events dropped")
        rank.steps(6)
        wait_for(lambda: a.refused == 6, 20, "the next refusal counted")
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and "403" in refusals[0] and "wrong bearer token" in refusals[0], \
        f"the stream's refused handshake has no reason, the POST after it does: {refusals}"
    assert read_model(shipped_file(events, 0), Shipped).refused == 6, "the count outlives the agent"
    assert control_plane.steps() == []
    assert control_plane.batches() == {"stream": 0, "post": 0}, "refused at the gate, the stream's handshake too"
    rank.steps(7)
    with agent(events, control_plane.url):
        wait_for(lambda: control_plane.steps() == [7], 20, "the next agent, with the right token, goes on from there")


def test_a_request_without_the_token_is_refused_before_its_body_is_read(control_plane):
    """It announces 10 GB and sends one byte: the answer comes at once, the body never read."""
    with socket.create_connection(("127.0.0.1", control_plane.port), timeout=5) as conn:
        conn.sendall(f"POST {ingest_path(0)} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: 10000000000\r\n\r\n{".encode())
        answer = b""
        while b"}" not in answer and (chunk := conn.recv(4096)):  # the head and the JSON body may come apart
            answer += chunk
    answer = answer.decode()
    assert answer.startswith("HTTP/1.1 401") and "missing bearer token" in answer, answer
