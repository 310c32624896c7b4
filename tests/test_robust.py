"""The bounded mean of a round's parts (robust.py) against a hand-written reference, and what one member can do."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.robust import bounded_mean
from p2p_diloco.trust import CLIP_FACTOR, DROP_FACTOR, RADIUS_FLOOR, WEIGHT_CAP


def reference(parts: list[list[float]], weights: list[float]) -> list[float]:
    """The rule of robust.py written out coordinate by coordinate, in plain Python."""
    kept = [
        i for i, (p, w) in enumerate(zip(parts, weights)) if w > 0 and math.isfinite(w) and all(map(math.isfinite, p))
    ]
    columns = list(zip(*(parts[i] for i in kept)))

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2

    def lower_median(values: list[float]) -> float:
        return sorted(values)[(len(values) - 1) // 2]

    center = [median(list(column)) if len(kept) > 2 else sum(column) / len(column) for column in columns]
    deviations = [[parts[i][k] - center[k] for k in range(len(center))] for i in kept]
    norms = [math.sqrt(sum(d * d for d in row)) for row in deviations]
    radius = max(CLIP_FACTOR * lower_median(norms), RADIUS_FLOOR * math.sqrt(sum(c * c for c in center)))
    scales = [min(1.0, radius / n) if n > 0 else 1.0 for n in norms]
    cap = WEIGHT_CAP * lower_median([weights[i] for i in kept])
    capped = [0.0 if n > DROP_FACTOR * radius else min(weights[i], cap) for i, n in zip(kept, norms)]
    total = sum(capped)
    return [center[k] + sum(capped[r] * scales[r] * deviations[r][k] for r in range(len(kept))) / total
            for k in range(len(center))]  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("members", [1, 2, 3, 4, 5])
def test_the_bounded_mean_follows_the_reference(seed: int, members: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    parts = [torch.randn(7, generator=generator) * (1 + 20 * (i == 0)) for i in range(members)]
    weights = [float(w) for w in torch.rand(members, generator=generator) * 3 + 0.1]
    if members > 1:
        weights[-1] = 50.0  # a claimed weight far above the others'
    result = bounded_mean(parts, weights)
    expected = reference([p.tolist() for p in parts], weights)
    assert result.value.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_parts_that_agree_up_to_rounding_are_all_kept() -> None:
    """Units on one model averaging φ: three parts equal, one off by fp32 rounding (the median deviation is 0). It is
    not far (nor an offence): the radius is at least RADIUS_FLOOR of the median's norm."""
    phi = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    parts = [phi.clone(), phi.clone(), phi.clone(), phi * (1 + 2e-9) + 1e-9]
    result = bounded_mean(parts, [1.0] * 4)
    assert not result.far and not result.clipped and max(result.excess) < 1.0
    assert torch.allclose(result.value, phi, atol=1e-6)


def test_honest_parts_of_similar_weight_get_their_weighted_mean() -> None:
    generator = torch.Generator().manual_seed(3)
    parts = [1.0 + 0.01 * torch.randn(50, generator=generator) for _ in range(4)]
    weights = [1.0, 1.2, 0.9, 1.1]
    result = bounded_mean(parts, weights)
    plain = sum(w * p for w, p in zip(weights, parts)) / sum(weights)
    assert torch.allclose(result.value, plain, atol=1e-6)
    assert result.invalid == result.far == result.clipped == result.capped == ()


def test_one_member_of_four_cannot_move_the_mean_far_nor_break_it() -> None:
    generator = torch.Generator().manual_seed(4)
    honest = [1.0 + 0.01 * torch.randn(50, generator=generator) for _ in range(3)]
    honest_mean = torch.stack(honest).mean(dim=0)
    spread = max(float((part - honest_mean).norm()) for part in honest)
    attacks = {
        "x1000": (honest[0] * 1000, 1.0),
        "sign-flip x3": (honest_mean - 3 * (honest[0] - honest_mean) - 3, 1.0),
        "noise": (honest[0] + torch.randn(50, generator=generator), 1.0),
        "weight x1000": (honest[0] + 0.5, 1000.0),
    }
    for name, (part, weight) in attacks.items():
        result = bounded_mean([*honest, part], [1.0, 1.0, 1.0, weight])
        moved = float((result.value - honest_mean).norm())
        assert moved <= WEIGHT_CAP / (3 + WEIGHT_CAP) * CLIP_FACTOR * 2 * spread + 1e-6, name
        assert max(result.relative[:3]) < 0.1 and (result.relative[3] > 10) == (name == "x1000"), name
    for bad_part, bad_weight in ((torch.full((50,), math.nan), 1.0), (honest[0], math.inf), (honest[0], -1.0)):
        result = bounded_mean([*honest, bad_part], [1.0, 1.0, 1.0, bad_weight])
        assert result.invalid == (3,) and torch.allclose(result.value, honest_mean, atol=1e-6)


def test_when_every_part_is_dropped_the_result_is_not_finite() -> None:
    result = bounded_mean([torch.full((3,), math.inf)], [1.0])
    assert result.invalid == (0,) and not result.value.isfinite().any()
    with pytest.raises(ValueError):
        bounded_mean([], [])
