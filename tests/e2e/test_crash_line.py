"""The line a crashed group's agent reports (service/agent/crash_line.py): picked from logs as
torchrun and the zygote's leader write them, and from a real group that fails at its start."""

from __future__ import annotations

import socket
import threading

from cluster import wait_for
from service.agent.crash_line import crash_line
from service.agent.supervisor import GroupCommand, GroupSupervisor

TORCHRUN_SUMMARY = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=====================================================
trainer FAILED
-----------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : -6 (pid: 7161)  (SIGABRT)
=====================================================
"""


def test_this_projects_one_line_error_wins():
    log = "=== starting group 0\ntrainer: error: --dataset /x does not exist; give a JSONL file\n" + TORCHRUN_SUMMARY
    assert crash_line(log) == "error: --dataset /x does not exist; give a JSONL file"


def test_a_ranks_exception_is_named_not_torchruns_summary():
    log = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1\n"
           "[rank0]: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n" + TORCHRUN_SUMMARY)
    assert crash_line(log) == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_a_cpp_exception_that_aborted_a_rank_is_named():
    log = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
           "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 852480 vs 524288.\n"
           "zygote leader: rank 0 (pid 7686) exited with -6; ending the group's other ranks\n")
    assert crash_line(log) == "C++ exception: [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 852480 vs 524288."


def test_without_an_error_the_last_line_that_says_something():
    assert crash_line("starting\nKilled\n=====\n") == "Killed"
    assert crash_line("") is None
    assert len(crash_line("trainer: error: " + "x" * 1000)) == 300


def test_a_group_that_fails_at_its_start_reports_its_error_line_in_the_crashed_event(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    events: list[tuple[str, dict]] = []
    seen = threading.Event()

    def on_event(kind: str, **fields) -> None:
        events.append((kind, fields))
        if kind != "started":
            seen.set()

    command = GroupCommand(0, 1, ["--lighthouse", f"http://127.0.0.1:{closed}"], None, tmp_path / "group0.log")
    supervisor = GroupSupervisor(command, tmp_path / "group0.pid", on_event, restart_policy=None)
    try:
        supervisor.start()
        wait_for(seen.is_set, 120, "the group to exit")
    finally:
        supervisor.shutdown()
    kind, fields = events[-1]
    assert kind == "crashed" and fields["returncode"] != 0
    assert fields["detail"].startswith(f"error: cannot reach the torchft Lighthouse at http://127.0.0.1:{closed}"), fields
