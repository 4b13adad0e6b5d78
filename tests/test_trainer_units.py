"""The trainer's pure parts: data order, corpus reading, settings, the event sink."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protocol.events import StepEvent, parse_event
from trainer.corpus import read_corpus
from trainer.data import BatchPlan, TokenBatches
from trainer.errors import ConfigError
from trainer.telemetry import EventSink

REPO = Path(__file__).resolve().parents[1]


def test_no_two_group_rank_step_share_a_sample_and_batches_are_reproducible():
    corpus = read_corpus(None, 1 << 20)
    plan = BatchPlan(len(corpus), seq_len=64, groups=3, ranks_per_group=2, per_rank_batch=2, seed=7)
    seen: dict[int, tuple] = {}
    for step, group, rank in itertools.product(range(40), range(3), range(2)):
        for window in plan.window_indices(step, group, rank):
            assert window not in seen, f"{(step, group, rank)} repeats the sample of {seen[window]}"
            seen[window] = (step, group, rank)
    again = TokenBatches(read_corpus(None, 1 << 20), BatchPlan(len(corpus), 64, 3, 2, 2, 7))
    first = TokenBatches(corpus, plan).batch(11, 2, 1, torch.device("cpu"))
    second = again.batch(11, 2, 1, torch.device("cpu"))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert torch.equal(first[0][:, 1:], first[1][:, :-1]), "targets are the inputs shifted by one"
    other_seed = TokenBatches(corpus, BatchPlan(len(corpus), 64, 3, 2, 2, 8)).batch(11, 2, 1, torch.device("cpu"))
    assert not torch.equal(first[0], other_seed[0])


def test_default_corpus_is_python_source_text():
    text = read_corpus(None, 1 << 16).decode()
    assert "def " in text and "import " in text


def test_user_jsonl_and_text_files(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n\n" + json.dumps({"text": "second"}) + "\n")
    (tmp_path / "b.txt").write_text("plain text")
    assert read_corpus(tmp_path, 1 << 20) == b"hello world\nsecond\nplain text"
    (tmp_path / "bad.jsonl").write_text('{"no_text": 1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1 has no string 'text' field"):
        read_corpus(tmp_path, 1 << 20)


def test_event_sink_writes_schema_valid_lines_and_counts_drops(tmp_path):
    sink = EventSink(tmp_path, group=1, rank=0)
    fields = dict(step=1, committed=True, loss=2.0, lr=0.1, step_s=0.1, compute_s=0.1, allreduce_s=0.0,
                  commit_s=0.0, quorum_id=1, participants=2, participating=True, healed=False,
                  batches_committed=2, batches_skipped=0)
    sink.emit(StepEvent, **fields)
    sink.close()
    event = parse_event((tmp_path / "g1-r0.jsonl").read_text().splitlines()[0])
    assert isinstance(event, StepEvent) and event.group == 1 and event.loss == 2.0

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the events folder should be")
    sink = EventSink(blocked, group=0, rank=0, capacity=2)
    for _ in range(50):
        sink.emit(StepEvent, **fields)  # never raises, never blocks
    sink.close()
    assert sink.dropped == 50


def _trainer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "3", "--ranks-per-group", "2"], "--batch-size 3 does not divide across 2 ranks"),
    (["--data", "/nonexistent/corpus.txt"], "--data /nonexistent/corpus.txt does not exist"),
    (["--steps", "0"], "--steps: Input should be greater than or equal to 1"),
    (["--group", "2", "--groups", "2"], "group 2 is not below groups=2"),
    (["--lighthouse", "http://127.0.0.1:{port}"], "cannot reach the torchft Lighthouse"),
    # refused before the Lighthouse is dialled: no packet leaves for 10.77.0.1
    (["--advertise-host", "127.0.0.1", "--lighthouse", "http://10.77.0.1:29510"],
     "would advertise 127.0.0.1 (127.0.0.1, a loopback address) while the Lighthouse is at http://10.77.0.1:29510"),
])
def test_bad_configuration_is_one_clear_line(args, message):
    port = _closed_port()
    result = _trainer(*[a.format(port=port) for a in args])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainer: error: ") and message in lines[0], result.stderr


def test_unknown_flavor_is_one_clear_line(lighthouse):
    result = _trainer("--lighthouse", lighthouse, "--flavor", "llama-huge")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "trainer: error: unknown --flavor 'llama-huge'; choose one of debugmodel, 1B, 3B, 8B, 70B, 405B"
    ]


def test_help_explains_every_setting():
    result = _trainer("--help")
    assert result.returncode == 0
    from trainer.config import TrainerConfig

    for name in TrainerConfig.model_fields:
        assert "--" + name.replace("_", "-") in result.stdout


def test_a_restarted_lighthouses_quorum_id_never_names_an_old_membership():
    from trainer.fault_tolerance import membership_quorum_id

    old = membership_quorum_id(2, ["group1:aaa"], 5)
    assert membership_quorum_id(2, ["group0:bbb", "group1:aaa"], 5) != old, "the same id, another membership"
    assert membership_quorum_id(2, ["group1:aaa", "group0:bbb"], 5) == membership_quorum_id(2, ["group0:bbb", "group1:aaa"], 5)
    assert membership_quorum_id(3, ["group1:aaa"], 5) != old
    assert membership_quorum_id(2, ["group1:aaa"], 34) != old, "the same id and members, another Lighthouse's life"
    assert 0 <= old < 2**62


def test_both_groups_name_the_new_lighthouses_quorum_alike_though_only_one_saw_a_quorum_between():
    """Recorded (bench.faults, 2 groups, one Lighthouse restart in four): the old Lighthouse's
    quorum 2 held groups 0 and 1 from step 5; the new one formed quorum 1 of group 0 alone, which
    committed step 34, then its quorum 2 of both groups again. Group 1, still at step 33, must
    reconfigure too: it used to keep the old quorum's id and its process group (a 10 s heal)."""
    from trainer.fault_tolerance import QuorumFormation, membership_quorum_id

    both = ["group0:a", "group1:b"]

    def ids(answers: list[tuple[int, list[str], int, int]]) -> list[int]:
        formation = QuorumFormation()
        return [membership_quorum_id(q, members, formation.see(q, members, step, top))
                for q, members, step, top in answers]

    group0 = ids([(2, both, 5, 5), (2, both, 33, 33), (1, ["group0:a"], 33, 33), (2, both, 34, 34), (2, both, 35, 35)])
    group1 = ids([(2, both, 5, 5), (2, both, 33, 33), (2, both, 33, 34), (2, both, 35, 35)])
    assert group0[0] == group0[1] == group1[0] == group1[1], "a kept quorum keeps its id"
    assert group1[2] != group1[1], "group 1 reconfigures for the new Lighthouse's quorum 2"
    assert group0[3] == group1[2] and group0[4] == group1[3] == group1[2], "and both name it alike, step after step"
