"""The whole API fuzzed against a live job, as an operator's tool would hit it: Schemathesis's CLI
with every check it has, against `ftctl up`'s control plane while its groups train. It kills,
drains, evicts and drills the job with valid and invalid requests; every answer must be
documented, valid against its schema, and never a 500 (a documented 502 or 503 while an agent or
the Lighthouse is away is an answer, ``tests/api_checks.py``). The registration route is left
to the in-process fuzz (``tests/unit/test_api_fuzz.py``): the addresses it generates would make
this control plane challenge hosts this machine must not reach."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cluster import REPO
from up_job import TOKEN, all_training_again, ftctl_up

EXAMPLES = 25


def test_a_live_job_answers_every_fuzzed_request_as_documented(tmp_path):
    with ftctl_up(tmp_path, ranks_per_group=1) as job:
        all_training_again(job.control)
        base = str(job.api.base_url).rstrip("/")
        ran = subprocess.run(
            [str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(REPO / "tests" / "schemathesis.toml"),
             "run", f"{base}/openapi.json", "--checks", "all",
             "--exclude-checks", "not_a_server_error", "--max-examples", str(EXAMPLES), "--seed", "7",
             "--header", f"Authorization: Bearer {TOKEN}", "--request-timeout", "30", "--workers", "1",
             "--exclude-path", "/api/v1/events/stream", "--exclude-path", "/api/v1/agents/{group}",
             "--suppress-health-check", "all", "--no-color"],
            cwd=tmp_path, capture_output=True, text=True, timeout=900,  # its cache goes there
            env={**os.environ, "SCHEMATHESIS_HOOKS": "api_checks",
                 "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])})
        assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-2000:]
        assert job.proc.poll() is None, "the job is still up after the fuzz"
