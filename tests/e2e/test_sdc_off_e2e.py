"""Why the gradient check exists: with it off (`--no-sdc-check`, plain HSDP), one corrupted
gradient element in one group reaches every group's optimizer, and the groups stay bitwise
equal, so fingerprints cannot tell. (With it on, tests/test_failover_e2e.py shows the same
drill skipped everywhere.)"""

from __future__ import annotations

import pytest

from cluster import wait_for
from up_job import all_training, ftctl, ftctl_up, json_out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with ftctl_up(tmp_path_factory.mktemp("sdc-off"), "--no-sdc-check", groups=2, ranks_per_group=1) as job:
        yield job


def test_without_the_check_a_corrupted_gradient_is_applied_in_every_group(job):
    wait_for(lambda: all_training(job.control), 240, "both groups training")
    result = ftctl(job.state, "drill", "corrupt", "--group", "1", "--json")
    assert result.returncode == 0, result.stderr
    drill = json_out(result)
    assert drill["status"] == "done", drill
    r = drill["report"]
    assert (r["sdc_check"], r["detected_group"], r["verdict"], r["action"]) == (False, None, None, "applied"), r
    for g in ("0", "1"):
        assert r["applied_grad_ratio"][g] > 5, f"group {g}'s optimizer took the corrupted gradient: {r}"
    assert r["applied_grad_ratio"]["0"] == pytest.approx(r["applied_grad_ratio"]["1"], rel=0.25), "one average"
    assert r["fingerprints_equal"] is True, "polluted alike: fingerprints see nothing"
    assert not any(s["skipped"] for s in r["steps"])
    assert job.control.sdc()["counts"] == {"transient": 0, "persistent": 0, "data": 0}
