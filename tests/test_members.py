"""A round member's gather, read as a stranger's words (p2p_diloco/network/members.py)."""

from __future__ import annotations

import math

import pytest

from p2p_diloco.network.members import MAX_TAG_CHARS, MemberInfo, read_member
from p2p_diloco.trust import MAX_ROUND_LEAD

HONEST = {"outer_round": 7, "weight": 256.0, "probe": [0.5, -1.0, 2.0], "tag": "fragment", "period": 4.0}


def test_an_honest_gather_is_read_as_sent() -> None:
    assert read_member(HONEST, own_round=7, probe_length=3) == MemberInfo(7, 256.0, (0.5, -1.0, 2.0), "fragment", 4.0)


def test_missing_fields_are_not_stated() -> None:
    assert read_member({}, own_round=3, probe_length=3) == MemberInfo()
    assert read_member({"outer_round": 2, "tag": ""}, own_round=3, probe_length=3) == MemberInfo(outer_round=2)


@pytest.mark.parametrize("value", [None, [1, 2], "gather", 7, b"\x00"])
def test_a_gather_that_is_not_a_mapping_says_nothing(value: object) -> None:
    info = read_member(value, own_round=3, probe_length=3)
    assert (info.outer_round, info.weight, info.probe, info.tag) == (-1, 0.0, (), "")
    assert info.problems


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1, 2.5, "7", True, [7], 10**30, {"a": 1}])
def test_a_round_that_is_not_a_round_number_is_not_believed(value: object) -> None:
    info = read_member({**HONEST, "outer_round": value}, own_round=7, probe_length=3)
    assert info.outer_round == -1 and "round" in info.problems[0]


def test_a_round_far_ahead_is_not_believed() -> None:
    assert read_member({**HONEST, "outer_round": 7 + MAX_ROUND_LEAD}, 7, 3).outer_round == 7 + MAX_ROUND_LEAD
    ahead = read_member({**HONEST, "outer_round": 8 + MAX_ROUND_LEAD}, 7, 3)
    assert ahead.outer_round == -1 and "ahead" in ahead.problems[0]
    assert read_member({**HONEST, "outer_round": 10**6}, 7, 3).outer_round == -1
    assert read_member({**HONEST, "outer_round": 0}, 7, 3).outer_round == 0  # behind is fine: a laggard catches up


@pytest.mark.parametrize("field", ["weight", "period"])
@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0, "1", True, [1.0]])
def test_numbers_out_of_range_read_as_zero(field: str, value: object) -> None:
    info = read_member({**HONEST, field: value}, own_round=7, probe_length=3)
    assert getattr(info, field) == 0.0 and field in info.problems[0]


@pytest.mark.parametrize("probe", [[1.0, 2.0], [1.0, 2.0, 3.0, 4.0], [1.0, math.nan, 2.0], ["x", "y", "z"], "abc",
                                   [1.0, None, 2.0], {"a": 1}])  # fmt: skip
def test_a_probe_of_another_length_or_with_non_numbers_is_dropped(probe: object) -> None:
    info = read_member({**HONEST, "probe": probe}, own_round=7, probe_length=3)
    assert info.probe == () and "probe" in info.problems[0]


@pytest.mark.parametrize("tag", [["a"], 5, "x" * (MAX_TAG_CHARS + 1)])
def test_a_tag_that_is_not_a_short_string_is_dropped(tag: object) -> None:
    info = read_member({**HONEST, "tag": tag}, own_round=7, probe_length=3)
    assert info.tag == "" and info.problems == ("tag is not a short string",)
