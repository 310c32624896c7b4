"""How far apart the swarm's models are, from the φ probes the units publish in their progress records (imports torch
only).

A unit's record carries ``record_probe`` of its φ: RECORD_PROBE_SIZE of its consensus-probe coordinates
(diloco.py ``consensus_probe``), spread over the probe. From the records of the live units, :func:`swarm_consensus`
gives the consensus distance (mean relative distance of the units' probes to their mean) and the lineages: the
groups of units whose probes are within ONE_MODEL_TOLERANCE of each other (linked pair by pair). One lineage means
one model. Units of one lineage differ by rounding (about 1e-9); lineages one outer step apart differ by 0.1–0.6 of
‖φ‖ with the tiny preset, so the tolerance separates them with orders of magnitude to spare.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

RECORD_PROBE_SIZE = 32
"""Probe values in a progress record (9 bytes each once packed)."""

ONE_MODEL_TOLERANCE = 1e-3
"""Two units hold one model when their probes are this close, relative to the larger probe's norm."""


@dataclass(frozen=True)
class SwarmConsensus:
    """``distance``: mean over units of ‖p − p̄‖ / ‖p̄‖ (0 for one unit); ``lineages``: how many models the units
    hold; ``units``: how many probes were compared."""

    distance: float
    lineages: int
    units: int

    def described(self, who: str) -> str:
        """For a person: ``<units> <who> hold <n> models (consensus distance <d>)``; ``who`` is plural ("training
        units"), and one unit reads "1 training unit holds"."""
        models = "one model" if self.lineages == 1 else f"{self.lineages} models"
        counted = f"1 {who.removesuffix('s')} holds" if self.units == 1 else f"{self.units} {who} hold"
        return f"{counted} {models} (consensus distance {self.distance:.2g})"


def record_probe(probe: Sequence[float], size: int = RECORD_PROBE_SIZE) -> list[float]:
    """``size`` values of ``probe`` at evenly spaced positions (all of it when it is shorter), the same positions on
    every unit with the same probe length; none when one is not finite (a record carries finite values only)."""
    values = [float(probe[index * len(probe) // size]) for index in range(size)] if len(probe) > size else list(probe)
    return values if all(math.isfinite(value) for value in values) else []


def swarm_consensus(probes: Sequence[Sequence[float]], tolerance: float = ONE_MODEL_TOLERANCE) -> SwarmConsensus:
    """The consensus of the units whose probes are ``probes``. Empty probes (older peers') and probes of another
    length than the most common one (another model's, or a stranger's) are left out; none left: distance 0, no
    lineage."""
    lengths = Counter(len(probe) for probe in probes if probe)
    if not lengths:
        return SwarmConsensus(0.0, 0, 0)
    length = lengths.most_common(1)[0][0]
    stacked = torch.tensor([list(probe) for probe in probes if len(probe) == length], dtype=torch.float64)
    mean = stacked.mean(dim=0)
    distance = float((stacked - mean).norm(dim=1).mean() / mean.norm().clamp_min(1e-30))
    lineages = lineage_sizes(len(stacked), pairwise_distances(list(stacked)), tolerance)
    return SwarmConsensus(distance, len(lineages), len(stacked))


def pairwise_distances(vectors: Sequence[torch.Tensor]) -> list[float]:
    """‖a − b‖ / max(‖a‖, ‖b‖) for every pair, in the order of ``itertools.combinations(vectors, 2)``."""
    if len(vectors) < 2:
        return []
    stacked = torch.stack(list(vectors)).double()
    norms = stacked.norm(dim=1)
    rows, cols = torch.triu_indices(len(vectors), len(vectors), offset=1)
    # the direct difference, not the matrix-product form, which loses distances below ~1e-8 of the norms
    exact = torch.cdist(stacked, stacked, compute_mode="donot_use_mm_for_euclid_dist")
    distances = exact[rows, cols] / torch.maximum(norms[rows], norms[cols]).clamp_min(1e-30)
    return distances.tolist()


def lineage_sizes(count: int, distances: Sequence[float], tolerance: float = ONE_MODEL_TOLERANCE) -> list[int]:
    """Sizes of the groups of ``count`` units linked by pairwise ``distances`` (as :func:`pairwise_distances` returns
    them) within ``tolerance``, largest first."""
    parent = list(range(count))

    def root(index: int) -> int:
        while parent[index] != index:
            index = parent[index]
        return index

    for (i, j), distance in zip(itertools.combinations(range(count), 2), distances):
        if distance <= tolerance:
            parent[root(i)] = root(j)
    return sorted(Counter(root(index) for index in range(count)).values(), reverse=True)
