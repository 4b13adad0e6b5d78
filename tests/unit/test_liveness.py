"""The lost-group decision, on what the control plane sees: agents' answers and heartbeats."""

from __future__ import annotations

from protocol.lighthouse import Heartbeat, LighthouseStatus, NextQuorum
from service.controlplane.liveness import beating_groups, groups_to_ask, lost_groups, quiet_groups

NOW = 1_800_000_000.0


def status(*beats: tuple[int | None, bool]) -> LighthouseStatus:
    return LighthouseStatus(quorum_id=3, next_quorum=NextQuorum(text="ok"), heartbeats=[
        Heartbeat(replica_id=f"group{g}:{i}", group=g, age_s=0.1, stale=stale) for i, (g, stale) in enumerate(beats)])


def test_a_group_is_lost_only_when_its_agent_is_silent_long_enough_and_no_heartbeat_speaks_for_it():
    beating = beating_groups(status((0, False), (1, True), (2, False)))
    assert beating == {0, 2}, "a stale heartbeat speaks for nobody"
    silent = {0: NOW - 5, 1: NOW - 5, 2: NOW - 1}
    assert lost_groups(NOW, silent, beating, lost_after_s=3) == {1}
    assert lost_groups(NOW, {1: NOW - 2.9}, beating, lost_after_s=3) == set(), "silent, but not long enough"


def test_a_restarted_groups_new_heartbeat_speaks_for_it_beside_its_old_stale_one():
    beating = beating_groups(status((1, True), (1, False), (None, False)))
    assert beating == {1}
    assert lost_groups(NOW, {1: NOW - 10}, beating, lost_after_s=3) == set()


def test_only_the_agents_of_quiet_groups_are_asked():
    """A group whose events keep arriving has an agent that forwards them: asking it is waste."""
    heard = {0: NOW - 0.2, 1: NOW - 1.5, 2: None, 3: NOW - 1.0}
    assert quiet_groups(NOW, heard, quiet_s=1.0) == {1, 2, 3}
    assert quiet_groups(NOW, heard, quiet_s=2.0) == {2}


def test_a_quiet_group_that_heartbeats_is_not_asked_and_a_lost_one_always_is():
    """An overloaded control plane hears late from every agent; asking them all would add to the load."""
    assert groups_to_ask(quiet={1, 2, 3}, beating={0, 1, 2}, lost=[5, 3]) == [3, 5]
    assert groups_to_ask(quiet=set(), beating=set(), lost=[]) == []
