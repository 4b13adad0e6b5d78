"""The partition rule on the reachability its agents report: no processes needed."""

from __future__ import annotations

import re
import time

import pytest

from service.controlplane.drills.partition import lost_group
from service.controlplane.errors import DrillConflict
from service.controlplane.partition import survivors


def rows(groups: range | list[int], cut: set[tuple[int, int]] = frozenset(), one_way: set[tuple[int, int]] = frozenset()):
    """Each group's answer: it reaches every other, except across ``cut`` (both ways) and
    ``one_way`` (from the first to the second only)."""
    return {g: {h: (g, h) not in cut and (h, g) not in cut and (g, h) not in one_way for h in groups if h != g}
            for g in groups}


def test_connected_groups_are_all_kept():
    v = survivors(rows(range(3)))
    assert (v.keep, v.evict, v.cut, v.partitioned) == ((0, 1, 2), (), (), False)


def test_a_cut_pair_keeps_the_lowest_numbered_of_the_largest_sets():
    """The issue's case: groups 1 and 2 cannot talk, both reach group 0 and the Lighthouse."""
    v = survivors(rows(range(3), cut={(1, 2)}))
    assert (v.keep, v.evict, v.cut) == ((0, 1), (2,), ((1, 2),))


def test_the_largest_set_wins_over_lower_numbers():
    v = survivors(rows(range(5), cut={(0, 1), (0, 2), (0, 3)}))
    assert (v.keep, v.evict) == ((1, 2, 3, 4), (0,))


def test_two_islands_of_equal_size_keep_the_one_with_the_lower_numbers():
    islands = {(g, h) for g in (0, 1) for h in (2, 3)}
    v = survivors(rows(range(4), cut=islands))
    assert (v.keep, v.evict) == ((0, 1), (2, 3))


def test_one_side_reaching_the_other_is_enough():
    """A handshake needs packets both ways: group 1's probe of group 2 failed on its own side."""
    v = survivors(rows(range(3), one_way={(2, 1)}))
    assert (v.keep, v.evict, v.cut) == ((0, 1, 2), (), ())


def test_a_group_whose_agent_did_not_answer_is_no_part_of_it():
    answers = rows([0, 1, 2])
    answers[0][3] = answers[1][3] = answers[2][3] = False  # group 3's agent is cut off from everyone
    v = survivors(answers)
    assert (v.keep, v.evict, v.cut) == ((0, 1, 2), (), ())


def test_a_cut_among_512_groups_is_decided_at_once():
    answers = rows(range(512), cut={(7, 300), (8, 9)})
    started = time.perf_counter()
    v = survivors(answers)
    assert time.perf_counter() - started < 5
    assert v.evict == (9, 300) and len(v.keep) == 510 and v.cut == ((7, 300), (8, 9))


def test_past_its_budget_the_search_answers_greedily(monkeypatch):
    import service.controlplane.partition as partition
    monkeypatch.setattr(partition, "MAX_BRANCHES", 1)
    v = survivors(rows(range(6), cut={(0, 1), (2, 3)}))
    assert (v.keep, v.evict) == ((0, 2, 4, 5), (1, 3))


def test_the_partition_drill_predicts_the_group_the_rule_evicts():
    assert lost_group([1, 2], None, [0, 1, 2]) == 2
    assert lost_group([2, 1], None, [0, 1, 2, 3]) == 2
    assert lost_group([0, 1], None, [0, 1]) == 1, "two groups: the lower number is kept"
    assert lost_group(None, 0, [0, 1, 2]) == 0, "an isolated group is the one lost"


def test_a_cut_naming_a_group_that_is_not_running_is_refused_in_one_line():
    """Found by the API fuzz: a cut of two groups never seen (state unknown) was a 500."""
    with pytest.raises(DrillConflict, match="groups 1 and 0 must both be running to be cut apart .running: none"):
        lost_group([1, 0], None, [])
    with pytest.raises(DrillConflict, match=r"\(running: 0, 2\)"):
        lost_group([1, 2], None, [0, 2])


def test_ftctl_drill_partition_says_in_one_line_what_it_needs(capsys):
    from protocol.settings import parse_settings
    from service.cli import ApiError, Ftctl

    def body(*flags: str) -> dict:
        return parse_settings(Ftctl, "ftctl", ["drill", "partition", *flags]).drill.body()

    assert body("--cut", "1,2", "--duration", "15") == {"kind": "partition", "cut": [1, 2], "duration_s": 15}
    assert body("--isolate", "2") == {"kind": "partition", "isolate": 2}
    for flags, said in (((), "drill partition: name either cut (two groups) or isolate (one group)"),
                        (("--cut", "1,2", "--isolate", "1"), "name either cut (two groups) or isolate"),
                        (("--cut", "1"), "drill partition: --cut: List should have at least 2 items"),
                        (("--cut", "1,2", "--group", "1"), "drill partition takes no --group")):
        with pytest.raises(ApiError, match=re.escape(said)):
            body(*flags)
    with pytest.raises(SystemExit) as exit_:  # the flag's own bounds, checked as it is parsed
        body("--cut", "1,-2")
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--cut" in line and "greater than or equal to 0" in line, line
