"""The trainer's settings, its one-line errors, the event sink and the quorum-id decisions."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.events import step_fields
from protocol.events import StepEvent, parse_event
from trainer.telemetry import EventSink

REPO = Path(__file__).resolve().parents[2]


def test_event_sink_writes_schema_valid_lines_and_counts_drops(tmp_path):
    sink = EventSink(tmp_path, group=1, rank=0)
    fields = step_fields(1, 2)
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


def test_an_event_its_own_schema_refuses_is_counted_and_said_once(tmp_path, caplog):
    sink = EventSink(tmp_path, group=1, rank=0)
    for _ in range(3):
        sink.emit(StepEvent, **{**step_fields(1, 2), "step": -1})
    sink.close()
    assert sink.dropped == 3
    [said] = [r.getMessage() for r in caplog.records if r.name == "trainer.events"]
    assert said.startswith("dropped a StepEvent event its schema refuses") and "step" in said, said


def _trainer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--dataset", "/nonexistent/corpus.txt"], "--dataset /nonexistent/corpus.txt does not exist"),
    (["--steps", "0"], "--steps: Input should be greater than or equal to 1"),
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


@pytest.mark.parametrize("args, message", [
    (["--global-batch-size", "5", "--groups", "2", "--batch-policy", "shrink"],
     "--global-batch-size 5 does not divide among 2 groups"),
    (["--config", "llama3_debugmdel"], "unknown --config 'llama3_debugmdel': no torchtitan config-registry function "
     "of that name (did you mean llama3_debugmodel"),
    (["--config", "llama3_debugmodel"], "llama3_debugmodel's tokenizer folder ./tests/assets/tokenizer is not a folder"),
    (["--config", "llama3_1b"], "llama3_1b's tokenizer folder is not set; give a Hugging Face tokenizer folder"),
    (["--config", "nowhere.configs:llama"], "--config nowhere.configs:llama: cannot import module 'nowhere.configs'"),
    (["--config", "trainer.configs:nope"], "trainer.configs has no config function 'nope'; it has llama3_debugmodel_bytes"),
    (["--seq-len", "300000"], "--seq-len 300000 is longer than llama3_debugmodel_bytes allows (131072 tokens)"),
    (["--device", "cuda"], "--device cuda needs 2 GPUs per group, this machine has 0"),
    (["--group", "2", "--groups", "2"], "group 2 is not below groups=2"),
    (["--replicate-backend", "nccl"], "--replicate-backend nccl needs --device cuda"),
])
def test_the_whole_job_is_checked_before_a_rank_starts(args, message):
    """The checks `python -m trainer --check` (and `ftctl up` before anything starts) makes, each
    a ConfigError or a settings error of one line: run here in one process, as the check runs them."""
    from pydantic import ValidationError

    from trainer.config import TrainerConfig
    from trainer.errors import ConfigError
    from trainer.launch import validate

    with pytest.raises((ConfigError, ValidationError)) as refused:
        validate(TrainerConfig(_cli_parse_args=args), dial_lighthouse=False)
    assert message in str(refused.value), refused.value


def test_a_job_resumed_past_its_steps_is_refused_and_one_before_them_says_where_it_resumes(tmp_path):
    """A second `ftctl up` in a state folder an earlier job used resumes that job's newest checkpoint."""
    from trainer.checkpoint import step_dir_name
    from trainer.config import TrainerConfig
    from trainer.errors import ConfigError
    from trainer.launch import validate

    (tmp_path / step_dir_name(50)).mkdir()
    (tmp_path / ".step-00000060.tmp-g0").mkdir()  # a save that never finished is no checkpoint
    args = ["--checkpoint-dir", str(tmp_path), "--check"]
    with pytest.raises(ConfigError, match=f"the checkpoint in {tmp_path} is at step 50, past --steps 40: nothing is "
                                          "left to train; raise --steps"):
        validate(TrainerConfig(_cli_parse_args=[*args, "--steps", "40"]), dial_lighthouse=False)
    summary = validate(TrainerConfig(_cli_parse_args=[*args, "--steps", "80"]), dial_lighthouse=False)
    assert summary.endswith(f"resuming the job in {tmp_path} from its checkpoint at step 50 to step 80"), summary


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
