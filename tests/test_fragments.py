"""Streaming fragments: exact coverage, balance, in-place views, staggered schedule and the in-flight bound."""

from __future__ import annotations

import random

import pytest
import torch

from p2p_diloco.fragments import assign, copies, due_fragments, first_round_offset, partition, views

# Shaped like the shipped tiny GPT-2: a tied 4096×128 embedding holds more than half of the weights.
TINY_GPT2 = [(4096, 128), (256, 128), (128,), (128,), (128, 384), (384,), (128, 128), (128,), (128, 512), (512,),
             (512, 128), (128,), (), (7, 0)]  # fmt: skip


def coverage(shapes, fragments) -> list[torch.Tensor]:
    counts = [torch.zeros(shape, dtype=torch.int64) for shape in shapes]
    for fragment in fragments:
        for view in views(counts, fragment):
            view += 1
    return counts


@pytest.mark.parametrize("count", [1, 2, 3, 4, 8, 16])
def test_partition_covers_every_parameter_element_exactly_once(count):
    fragments = partition(TINY_GPT2, count)
    assert [fragment.number for fragment in fragments] == list(range(count))
    assert all(bool((counts == 1).all()) for counts in coverage(TINY_GPT2, fragments))
    total = sum(torch.Size(shape).numel() for shape in TINY_GPT2)
    assert sum(fragment.numel for fragment in fragments) == total
    assert all(fragment.numel == sum(view.numel() for view in views(
        [torch.zeros(shape) for shape in TINY_GPT2], fragment)) for fragment in fragments)  # fmt: skip


@pytest.mark.parametrize("count", [2, 4, 8])
def test_partition_is_balanced_even_with_a_dominant_embedding(count):
    sizes = [fragment.numel for fragment in partition(TINY_GPT2, count)]
    assert max(sizes) <= 1.3 * min(sizes), sizes


def test_partition_is_deterministic_and_rejects_impossible_counts():
    assert partition(TINY_GPT2, 4) == partition(TINY_GPT2, 4)
    with pytest.raises(ValueError, match="at least 1"):
        partition(TINY_GPT2, 0)
    with pytest.raises(ValueError, match="too few rows"):
        partition([(2, 3)], 3)
    with pytest.raises(ValueError, match="no parameter elements"):
        partition([(0, 4)], 1)


def test_views_write_through_and_assign_round_trips():
    tensors = [torch.randn(shape) for shape in TINY_GPT2]
    original = [tensor.clone() for tensor in tensors]
    fragments = partition(TINY_GPT2, 3)
    for fragment in fragments:
        values = copies(tensors, fragment)
        assign(tensors, fragment, [value * 2 for value in values])
    assert all(torch.equal(tensor, 2 * before) for tensor, before in zip(tensors, original))
    with pytest.raises(ValueError, match="pieces"):
        assign(tensors, fragments[0], [])


def test_first_rounds_are_staggered_over_the_period():
    assert [first_round_offset(number, 4, 20) for number in range(4)] == [5, 10, 15, 20]
    assert first_round_offset(0, 1, 20) == 20
    assert first_round_offset(0, 8, 4) == 1


def test_due_fragments_orders_by_overdue_and_respects_the_bound():
    assert due_fragments([20, 25, 3, 40], busy=set(), free=2, inner_steps=[20] * 4) == [3, 1]
    assert due_fragments([20, 25, 3, 40], busy=set(), free=4, inner_steps=[25, 30, 3, 40]) == [3, 2], "its own H"
    assert due_fragments([20, 25, 3, 40], busy={3}, free=1, inner_steps=[20] * 4) == [1]
    assert due_fragments([20, 25, 3, 40], busy={0, 3}, free=0, inner_steps=[20] * 4) == []
    assert due_fragments([20, 25, 3, 40], busy={0, 3}, free=-1, inner_steps=[20] * 4) == [], "a bound already exceeded"


@pytest.mark.parametrize("count,max_in_flight", [(4, 1), (4, 2), (8, 3), (2, 2)])
def test_simulated_schedule_never_exceeds_the_in_flight_bound(count, max_in_flight):
    """Rounds take a random 1-30 inner steps to come back; every fragment still syncs, never above the bound."""
    rng = random.Random(count * 10 + max_in_flight)
    inner_steps = 20
    steps_since = [inner_steps - first_round_offset(number, count, inner_steps) for number in range(count)]
    arrives_at: dict[int, int] = {}
    rounds = [0] * count
    for step in range(1, 2000):
        steps_since = [value + 1 for value in steps_since]
        for number in [number for number, at in arrives_at.items() if at <= step]:
            del arrives_at[number]
            steps_since[number] = 0
            rounds[number] += 1
        free = max_in_flight - len(arrives_at)
        for number in due_fragments(steps_since, arrives_at.keys(), free, [inner_steps] * count):
            arrives_at[number] = step + rng.randint(1, 30)
        assert len(arrives_at) <= max_in_flight
    assert min(rounds) >= 2000 // (inner_steps + 30 * count) > 0
