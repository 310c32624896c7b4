"""A weighted mean that no single member can move far: the reducer's rule of a round (torch only).

Each member of a group sends a part of its tensors with a weight it states itself. :func:`bounded_mean` combines
the parts of one slice so that one member's part has bounded influence, whatever it sends:

1. a part with non-finite values (or so large that its sum overflows float32), or a weight that is not a positive
   finite number, is dropped (that member only);
2. weights are capped at ``weight_cap`` × the lower median weight of the kept parts (a claimed weight is
   unverifiable; honest units with the same hardware and batch state similar token counts);
3. centred clipping: around the coordinate-wise median ``c`` of the kept parts (the mean of one or two), a part whose
   deviation ``x − c`` is over ``drop`` × the radius (``clip`` × the lower median of the deviation norms, and at
   least ``RADIUS_FLOOR`` × ‖c‖: parts that agree up to rounding are not far from each other) is dropped, and every
   other deviation is scaled down to at most the radius;
4. the result is ``c`` plus the capped-weight mean of the clipped deviations of the parts not dropped.

Given a ``reference`` (the payload of a member that trained nothing since φ: rounds/kinds.py), it also returns the
Gram matrix of the parts' steps ``x − r``, from which the reducer judges a member's direction over its whole slice
(network/reducer.py): a flipped step of honest length deviates from ``c`` little more than an honest one, but points
away from the honest steps.

With honest parts this is the weighted mean (up to the rare clipped or capped part). With two members nothing tells
which one is wrong: their deviations from the median are equal, so the rule is the plain mean; with three or more a
single member moves the result by at most about its capped weight share × ``clip`` × the typical deviation, and one
that sends something far off (scaled up, noise) is left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2p_diloco.trust import CLIP_FACTOR, DROP_FACTOR, RADIUS_FLOOR, WEIGHT_CAP

SORTING_NETWORK_ROWS = 8


@dataclass(frozen=True)
class BoundedMean:
    """The combined part, and what happened to each member's part (indices into the inputs)."""

    value: torch.Tensor
    invalid: tuple[int, ...] = ()  # non-finite parts or weights that are not positive finite numbers
    far: tuple[int, ...] = ()  # parts dropped for a deviation over ``drop`` × the radius
    clipped: tuple[int, ...] = ()
    capped: tuple[int, ...] = ()
    excess: tuple[float, ...] = ()  # per input: its deviation norm over the clipping radius (0 for invalid parts)
    deviation: tuple[float, ...] = ()  # per input: the norm of its deviation from the median (0 for invalid parts)
    center_norm: float = 0.0  # the norm of the coordinate-wise median of the kept parts
    step_gram: torch.Tensor | None = None  # with a reference r: <x_i − r, x_j − r> (float64; 0 for invalid inputs)

    @property
    def relative(self) -> tuple[float, ...]:
        """Per input: its deviation norm over the median's norm."""
        return tuple(_ratio(deviation, self.center_norm) for deviation in self.deviation)


def bounded_mean(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    clip: float = CLIP_FACTOR,
    drop: float = DROP_FACTOR,
    weight_cap: float = WEIGHT_CAP,
    reference: torch.Tensor | None = None,
) -> BoundedMean:
    """The bounded weighted mean of ``parts`` (same shapes) by ``weights`` (see the module docstring), with each part's
    step measured from ``reference`` when one is given. When every part is dropped, the value is all NaN (the
    caller's non-finite check rejects the round)."""
    if len(parts) != len(weights) or not parts:
        raise ValueError("need as many weights as parts, and at least one part")
    every = torch.stack([part.float() for part in parts])
    finite = every.flatten(1).sum(dim=1).isfinite()  # one pass: any inf or NaN (or an overflowing part) shows
    kept = [i for i, weight in enumerate(weights) if bool(finite[i]) and _usable(weight)]
    invalid = tuple(i for i in range(len(parts)) if i not in kept)
    if not kept:
        nothing = torch.full_like(parts[0], math.nan, dtype=torch.float32)
        return BoundedMean(nothing, invalid, excess=(0.0,) * len(parts), deviation=(0.0,) * len(parts))
    stacked = every if len(kept) == len(parts) else every[kept]
    center = coordinate_median(stacked) if len(kept) > 2 else stacked.mean(dim=0)
    deviations = stacked - center
    norms = deviations.flatten(1).norm(dim=1).double()
    center_norm = float(center.double().norm())
    radius = max(clip * float(norms.median()), RADIUS_FLOOR * center_norm)
    scale = torch.where(norms > radius, radius / norms.clamp_min(1e-30), torch.ones_like(norms))
    far_rows = norms > drop * radius
    scale = torch.where(far_rows, torch.zeros_like(scale), scale).float()
    kept_weights = torch.tensor([float(weights[i]) for i in kept], dtype=torch.float64)
    cap = weight_cap * float(kept_weights.median())
    capped_weights = kept_weights.clamp(max=cap).masked_fill(far_rows, 0.0)
    mixing = (capped_weights / capped_weights.sum()).float()
    shift = ((scale * mixing) @ deviations.flatten(1)).view_as(center)
    excess, deviation = [0.0] * len(parts), [0.0] * len(parts)
    for row, index in enumerate(kept):
        excess[index] = _ratio(float(norms[row]), radius)
        deviation[index] = float(norms[row])
    return BoundedMean(
        center + shift,
        invalid,
        far=tuple(kept[row] for row in range(len(kept)) if far_rows[row]),
        clipped=tuple(kept[row] for row in range(len(kept)) if 0 < scale[row] < 1),
        capped=tuple(kept[row] for row in range(len(kept)) if kept_weights[row] > cap),
        excess=tuple(excess),
        deviation=tuple(deviation),
        center_norm=center_norm,
        step_gram=_step_gram(stacked, reference, kept, len(parts)),
    )


def _step_gram(
    stacked: torch.Tensor, reference: torch.Tensor | None, kept: list[int], count: int
) -> torch.Tensor | None:
    """BoundedMean's ``step_gram`` (None without a reference)."""
    if reference is None:
        return None
    steps = stacked.flatten(1) - reference.float().flatten()
    rows = torch.tensor(kept)
    gram = torch.zeros(count, count, dtype=torch.float64)
    gram[rows[:, None], rows[None, :]] = (steps @ steps.T).double()  # a part's sums in float32
    return gram


def _ratio(value: float, scale: float) -> float:
    return value / scale if scale > 0 else (math.inf if value > 0 else 0.0)


def coordinate_median(stacked: torch.Tensor) -> torch.Tensor:
    """The median over dim 0 of ``stacked`` (the mean of the two middle values for an even count), like
    ``quantile(0.5, dim=0)``; up to SORTING_NETWORK_ROWS rows by an odd-even transposition sort of the rows (min/max
    of whole rows: several times faster than sorting along dim 0 for the few members of a group)."""
    count = stacked.shape[0]
    if count > SORTING_NETWORK_ROWS:
        ordered = list(stacked.sort(dim=0).values.unbind(0))
    else:
        ordered = list(stacked.unbind(0))
        for phase in range(count):
            for row in range(phase % 2, count - 1, 2):
                low, high = ordered[row], ordered[row + 1]
                ordered[row], ordered[row + 1] = torch.minimum(low, high), torch.maximum(low, high)
    return (ordered[(count - 1) // 2] + ordered[count // 2]) / 2


def _usable(weight: float) -> bool:
    return isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0
