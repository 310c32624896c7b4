"""Eval-loss curves as ``(x, loss)`` points, x being tokens or seconds: the loss at an x and where a loss is first
reached, both interpolated linearly between points (reports of every benchmark share these)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def loss_at(curve: Sequence[tuple[float, float]], x: float) -> float:
    """The curve's loss at ``x``, linear between its points and held at its ends. ValueError for an empty curve."""
    if not curve:
        raise ValueError("an empty curve has no loss")
    xs, losses = zip(*sorted(curve))
    return float(np.interp(x, xs, losses))


def first_reach(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The x at which the curve, in order of x, first gets to ``target`` or below, linear between the last point above
    it and the first at or below it (a coarse cadence of points would otherwise count up to one interval too many);
    None when it never does."""
    ordered = sorted(curve)
    for index, (x, loss) in enumerate(ordered):
        if loss > target:
            continue
        if index == 0:
            return float(x)
        before_x, before_loss = ordered[index - 1]
        return float(before_x + (before_loss - target) / (before_loss - loss) * (x - before_x))
    return None
