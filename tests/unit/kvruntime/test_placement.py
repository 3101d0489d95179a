"""Where a mixed-TP group's ranks run (kvruntime/tools/placement.py): one device a rank, prefill
ranks first, round robin when ranks outnumber devices; an explicit placement instead; the named
scenarios lay their groups as the issue asks (4 GPUs: TP2 -> TP2 on 0,1 -> 2,3, ...)."""

import pytest

from kvruntime.tools.placement import SCENARIOS, Group, Placement, parse_group, parse_ids, place
from kvruntime.tools.tp_group import ENGINES, kv_buffer_sets
from kvruntime.tools.workload import BENCH_HEADS

FOUR = [0, 1, 2, 3]


@pytest.mark.parametrize("text,group,ranks", [
    ("2x2", Group(2, 2), 4), ("2x1x2", Group(2, 1, 2), 4), ("1x2", Group(1, 2), 3),
    ("2x4", Group(2, 4), 6), ("4x2", Group(4, 2), 6), ("8x1x1", Group(8, 1), 9)])
def test_groups_parse(text, group, ranks):
    assert parse_group(text, 8) == group and group.ranks == ranks
    assert group.label == ("8x1" if text == "8x1x1" else text)  # one instance: no suffix


@pytest.mark.parametrize("text,why", [
    ("2", "is not PxD or PxDxN"), ("2x1x2x2", "is not PxD or PxDxN"), ("0x1", "is not PxD"),
    ("2x1x0", "is not PxD"), ("ax2", "is not PxD"), ("3x1", "TP size 3 in '3x1' does not split "
                                                         "the model's 8 KV heads (TP sizes "
                                                         "here: 1, 2, 4, 8)")])
def test_bad_groups_say_why(text, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        parse_group(text, 8)


def test_one_device_a_rank_prefill_first():
    assert place(Group(2, 2), FOUR) == Placement((0, 1), ((2, 3),))
    assert place(Group(2, 1, 2), FOUR) == Placement((0, 1), ((2,), (3,)))
    assert place(Group(1, 2), FOUR) == Placement((0,), ((1, 2),))


def test_round_robin_doubles_ranks_up_only_where_they_must():
    assert place(Group(2, 4), FOUR) == Placement((0, 1), ((2, 3, 0, 1),))
    assert place(Group(4, 2), FOUR) == Placement((0, 1, 2, 3), ((0, 1),))
    assert place(Group(2, 1), [0, 1]) == Placement((0, 1), ((0,),))
    assert place(Group(1, 2), [0, 1]) == Placement((0,), ((1, 0),))
    assert place(Group(4, 2), [5]) == Placement((5,) * 4, ((5, 5),))  # one GPU: all on it


def test_an_explicit_placement_wins_and_must_name_every_rank():
    assert place(Group(4, 2), FOUR, (0, 1, 2, 3, 2, 3)) == Placement((0, 1, 2, 3), ((2, 3),))
    with pytest.raises(ValueError, match="names 2 device.*group 2x1x2 has 4 ranks"):
        place(Group(2, 1, 2), FOUR, (0, 1))
    assert place(Group(2, 2), FOUR).as_dict() == {"prefill": [0, 1], "decode": [[2, 3]]}


@pytest.mark.parametrize("text,ids", [("0,1,2,3", (0, 1, 2, 3)), ("7", (7,))])
def test_ids_parse(text, ids):
    assert parse_ids(text) == ids


@pytest.mark.parametrize("text", ["", "0,,1", "0,-1", "a"])
def test_bad_ids_say_what_is_expected(text):
    with pytest.raises(ValueError, match="is not a list of device ids like 0,1,2,3"):
        parse_ids(text)


def test_the_four_gpu_scenario_is_the_issues():
    s = SCENARIOS["tp-4gpu"]
    laid = {g: place(parse_group(g, BENCH_HEADS), s["device_ids"]) for g in s["groups"]}
    assert laid["2x2"] == Placement((0, 1), ((2, 3),))          # GPUs 0,1 -> 2,3
    assert laid["2x1x2"] == Placement((0, 1), ((2,), (3,)))     # two decode instances at once
    assert laid["1x2"].prefill == (0,) and len(set(laid["1x2"].decode[0])) == 2
    assert set(laid) >= {"2x4", "4x2"}
    two = SCENARIOS["tp-2gpu"]
    assert two["groups"] == ["2x1", "1x2"] and two["device_ids"] == [0, 1]


def test_the_engine_list_is_open_and_staged_gets_processes_of_its_own_on_a_device():
    assert set(ENGINES) >= {"samenode", "nixl", "staged"}
    assert kv_buffer_sets("cpu") == [("device", "host_staged")]
    assert kv_buffer_sets("cuda") == [("device",), ("host_staged",)]


def test_a_group_is_skipped_whole_when_one_rank_cannot_take_the_engine():
    """2x4 on 4 GPUs doubles ranks up: a decode rank on its prefill rank's GPU connects through
    the same-node engine while its neighbours on other GPUs are refused. Seen on 4 x H100: that
    rank was reported failed ("another rank of the group failed to connect"); the group is skipped
    whole instead, each rank saying why."""
    from kvruntime.tools.selftest import _tp_entry
    from kvruntime.tp import HeadSlice

    group = parse_group("2x4", 8)
    placement = place(group, FOUR)
    why = "same-node engine unavailable: head slices across GPUs"
    slices = [HeadSlice(1, (0, 1), (0, 1))]
    ok = _tp_entry(group, placement, (0, 3), "pull", "samenode", "cuda", {"engine": "samenode"},
                   None, slices, refused=why)
    assert ok["status"] == "skipped" and ok["reason"] == f"another rank of the group: {why}"
    own = _tp_entry(group, placement, (0, 0), "pull", "samenode", "cuda", {"skipped": why},
                    None, slices, refused=why)
    assert own["status"] == "skipped" and own["reason"] == why
    broken = _tp_entry(group, placement, (0, 1), "pull", "samenode", "cuda", {"error": "boom"},
                       None, slices, refused=why)
    assert broken["status"] == "failed" and broken["reason"] == "boom"
