"""The decoupled DiLoCo algorithm as pure functions on lists of tensors (imports torch only).

Vocabulary: θ = a learning unit's local parameters (trained by the inner optimizer), φ = its copy of the
global parameters (last consensus), m = outer momentum, Δ = φ − θ = pseudo-gradient.

How a round is averaged without a coordinator. Each unit computes its *proposal*, the outer step it would
take on its own pseudo-gradient, ``(φ', m') = outer_step(φ, m, Δ_i)``, and the group averages the proposals
(weighted by tokens processed since the last round). The Nesterov outer step is affine in (φ, m, Δ), so
when the group members start from the same φ and m the averaged proposal equals the outer step on the
averaged pseudo-gradient, exactly (tested against ``torch.optim.SGD``). When they do not (after a group
split, a partial all-reduce or a late join), averaging proposals also averages φ and m: every round pulls
the members' global parameters back together, which is the consensus mechanism of the swarm.

Merge rule: the group's weighted mean of Δ by default; with radial-directional averaging (RDA, Decoupled DiLoCo) each
tensor's norm and unit direction are averaged separately (:func:`radial_parts`, :func:`radial_merge`), embeddings
by their plain mean.

Overlap: the average of a round arrives τ inner steps after the unit sent its proposal, and the unit went
on training meanwhile. :func:`merge_local_progress` keeps those τ steps, d = θ_now − θ_sent, by one of the rules of
:class:`Overlap` (by default whole: θ ← φ_new + d).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from p2p_diloco.config import OverlapRule

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class OuterHyperparams:
    """The outer SGD step's settings (their defaults are the ``[outer]`` config's)."""

    lr: float
    momentum: float
    nesterov: bool


def pseudo_gradient(global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor]) -> Tensors:
    """Δ = φ − θ in φ's dtype and on φ's device. Raises ValueError if the two lists do not match."""
    _check_same_shapes(global_params, local_params)
    return [
        phi.detach() - theta.detach().to(device=phi.device, dtype=phi.dtype)
        for phi, theta in zip(global_params, local_params)
    ]


def outer_step(
    global_params: Sequence[torch.Tensor],
    momentum: Sequence[torch.Tensor],
    pseudo_grad: Sequence[torch.Tensor],
    hyper: OuterHyperparams,
) -> tuple[Tensors, Tensors]:
    """One SGD step (PyTorch's convention, Nesterov optional) on φ with gradient Δ; returns new (φ, m).

    m' = μ·m + Δ;  φ' = φ − lr·(Δ + μ·m') with Nesterov, φ' = φ − lr·m' without.
    At μ = 0 no momentum needs to exist (a unit keeps none): an empty ``momentum`` gives φ' = φ − lr·Δ and an empty m'.
    Inputs are not modified. Raises ValueError for lists that do not match (an empty momentum at μ > 0 included).
    """
    _check_same_shapes(global_params, pseudo_grad)
    if not momentum and hyper.momentum == 0:
        return [phi - hyper.lr * g for phi, g in zip(global_params, pseudo_grad)], []
    _check_same_shapes(global_params, momentum)
    new_momentum = [hyper.momentum * m + g for m, g in zip(momentum, pseudo_grad)]
    if hyper.nesterov:
        updates = [g + hyper.momentum * m for g, m in zip(pseudo_grad, new_momentum)]
    else:
        updates = new_momentum
    new_params = [phi - hyper.lr * update for phi, update in zip(global_params, updates)]
    return new_params, new_momentum


def step_in_place(global_params: Sequence[torch.Tensor], pseudo_grad: Sequence[torch.Tensor], lr: float) -> Tensors:
    """:func:`outer_step` at μ = 0 without a momentum (φ' = φ − lr·Δ, the same values) written into ``pseudo_grad``,
    which is returned: a round's payload then costs one copy of the fragment less. Raises ValueError for lists that do
    not match."""
    _check_same_shapes(global_params, pseudo_grad)
    for phi, g in zip(global_params, pseudo_grad):
        torch.sub(phi, g.mul_(lr), out=g)
    return list(pseudo_grad)


def weighted_average(proposals: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> Tensors:
    """Reference weighted mean of several units' tensor lists (what the all-reduce computes).

    Raises ValueError for an empty group, a non-positive total weight or mismatched lists.
    """
    if not proposals or len(proposals) != len(weights):
        raise ValueError("need one weight per proposal and at least one proposal")
    total = float(sum(weights))
    if not all(math.isfinite(weight) and weight >= 0 for weight in weights) or not total > 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    for other in proposals[1:]:
        _check_same_shapes(proposals[0], other)
    return [
        torch.stack([weight / total * proposal[index] for proposal, weight in zip(proposals, weights)]).sum(dim=0)
        for index in range(len(proposals[0]))
    ]


def radial_parts(pseudo_grad: Sequence[torch.Tensor], radial: Sequence[bool]) -> tuple[Tensors, torch.Tensor]:
    """What a unit sends for a radial-directional merge: per tensor its unit direction Δ/‖Δ‖ (``radial``) or Δ itself
    (the others, merged by their plain mean), and one vector of the radial tensors' norms ‖Δ‖ (0 for the others).
    A zero Δ has a zero direction. Raises ValueError when ``radial`` does not hold one flag per tensor."""
    if len(radial) != len(pseudo_grad):
        raise ValueError(f"{len(radial)} radial flags for {len(pseudo_grad)} tensors")
    norms = [float(delta.norm()) if flag else 0.0 for delta, flag in zip(pseudo_grad, radial)]
    directions = [
        _unit(delta, norm) if flag else delta.clone() for delta, flag, norm in zip(pseudo_grad, radial, norms)
    ]
    return directions, torch.tensor(norms)


def radial_merge(directions: Sequence[torch.Tensor], norms: torch.Tensor, radial: Sequence[bool]) -> Tensors:
    """Radial-directional averaging (RDA): the merged Δ from the group's means of :func:`radial_parts`. A radial
    tensor gets the mean norm along the mean unit direction, ``n̄ · ū/‖ū‖`` (0 when ū is 0); the others are their plain
    mean already. When every member's Δ points the same way this equals the weighted mean of the Δ's; unlike the mean,
    it does not shrink an update whose members point in different directions."""
    if not len(radial) == len(directions) == norms.numel():
        raise ValueError(f"{len(radial)} radial flags, {len(directions)} directions and {norms.numel()} norms")
    return [
        _unit(direction, float(direction.norm())) * norm if flag else direction
        for direction, norm, flag in zip(directions, norms.tolist(), radial)
    ]


def _unit(tensor: torch.Tensor, norm: float) -> torch.Tensor:
    """``tensor / norm``; zeros for a zero norm."""
    return tensor / norm if norm > 0 else torch.zeros_like(tensor)


@dataclass(frozen=True)
class Overlap:
    """What a unit keeps of the inner steps it made while a round was in flight, d = θ_now − θ_sent (computed from its
    own parameters before the average), when the round's φ_new arrives:

    - ``keep``: θ ← φ_new + d, all of it;
    - ``discount``: θ ← φ_new + factor·d;
    - ``align``: θ ← φ_new + d', where per tensor d' is d less its part that opposes the round's step u = φ_new − φ_old
      (d' = d − min(0, ⟨d, u⟩)/‖u‖² · u): direction-aware, after HeLoCo, with the swarm's step of this round as the
      reference direction (no outer momentum needed);
    - ``mix``: θ ← factor·θ_now + (1 − factor)·φ_new (Streaming DiLoCo's merge).
    """

    rule: OverlapRule = "keep"
    factor: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.factor <= 1.0:
            raise ValueError(f"the overlap factor must lie in [0, 1], got {self.factor}")


def merge_local_progress(
    new_global: Sequence[torch.Tensor],
    local_now: Sequence[torch.Tensor],
    local_at_send: Sequence[torch.Tensor],
    overlap: Overlap = Overlap(),
    old_global: Sequence[torch.Tensor] = (),
) -> Tensors:
    """New local parameters after a round by the ``overlap`` rule, in θ's dtype and device; ``old_global`` is φ
    before the round (read by ``align`` only).

    With no overlap (θ_now = θ_sent) ``keep``, ``discount`` and ``align`` give θ ← φ_new, the synchronous DiLoCo rule.
    Raises ValueError for lists that do not match (a missing ``old_global`` under ``align`` included).
    """
    _check_same_shapes(new_global, local_now)
    _check_same_shapes(new_global, local_at_send)
    if overlap.rule == "align":
        _check_same_shapes(new_global, old_global)
    merged = []
    for index, (phi, now, sent) in enumerate(zip(new_global, local_now, local_at_send)):
        now_here = now.detach().to(device=phi.device, dtype=phi.dtype)
        drift = now_here - sent.to(device=phi.device, dtype=phi.dtype)
        if overlap.rule == "discount":
            value = phi + overlap.factor * drift
        elif overlap.rule == "align":
            value = phi + _without_opposing(drift, phi - old_global[index].to(device=phi.device, dtype=phi.dtype))
        elif overlap.rule == "mix":
            value = overlap.factor * now_here + (1.0 - overlap.factor) * phi
        else:
            value = phi + drift
        merged.append(value.to(device=now.device, dtype=now.dtype))
    return merged


def _without_opposing(drift: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``drift`` less its component along ``reference`` when that component points against it."""
    squared = float(reference.pow(2).sum())
    along = float((drift * reference).sum()) / squared if squared > 0 else 0.0
    return drift - along * reference if along < 0 else drift


def distance(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> float:
    """‖first − second‖ over all tensors together (in float64, on ``first``'s devices). Raises ValueError if the
    lists do not match."""
    _check_same_shapes(first, second)
    squares = sum(float((a.double() - b.to(device=a.device).double()).pow(2).sum()) for a, b in zip(first, second))
    return math.sqrt(squares)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when no tensor holds a NaN or an infinity."""
    return all(bool(torch.isfinite(tensor).all()) for tensor in tensors)


def _check_same_shapes(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> None:
    if len(first) != len(second):
        raise ValueError(f"tensor lists differ in length: {len(first)} vs {len(second)}")
    for index, (a, b) in enumerate(zip(first, second)):
        if a.shape != b.shape:
            raise ValueError(f"tensor {index} differs in shape: {tuple(a.shape)} vs {tuple(b.shape)}")


def consensus_probe_indices(global_params: Sequence[torch.Tensor], size: int = 1024, seed: int = 0) -> torch.Tensor:
    """Fixed pseudo-random flat coordinates of φ, sorted; identical on every unit with the same architecture."""
    total = sum(tensor.numel() for tensor in global_params)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, total, (min(size, total),), generator=generator).sort().values


def consensus_probe(global_params: Sequence[torch.Tensor], indices: torch.Tensor) -> list[float]:
    """φ at the probe coordinates (sorted flat indices over the concatenated tensors), read tensor by tensor
    without copying φ: units compare probes to estimate their drift without sending φ."""
    values: list[float] = []
    offset = 0
    for tensor in global_params:
        count = tensor.numel()
        inside = indices[(indices >= offset) & (indices < offset + count)] - offset
        values += tensor.detach().reshape(-1)[inside.to(tensor.device)].float().cpu().tolist()
        offset += count
    return values


def probe_drift(probes: Sequence[Sequence[float]]) -> float:
    """max over pairs of ‖a − b‖, divided by the largest ‖a‖: the units' relative drift (0 for fewer than two)."""
    if len(probes) < 2:
        return 0.0
    stacked = torch.tensor(probes, dtype=torch.float64)
    reference_norm = stacked.norm(dim=1).max().clamp_min(1e-30)
    distances = torch.cdist(stacked, stacked, compute_mode="donot_use_mm_for_euclid_dist")
    return float(distances.max() / reference_norm)
