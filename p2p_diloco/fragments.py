"""Streaming: the model split into P fragments that sync on staggered schedules (imports torch only).

A fragment is a set of row ranges of the trained parameters (``Piece``: rows ``start:stop`` along dim 0 of parameter
``index``). :func:`partition` covers every element of every parameter exactly once and balances the fragments by
element count: a parameter larger than half a fragment's share (typically the token embedding, which is tied to the
output layer in small models and can hold most of the weights) is cut into row blocks, so no fragment is dominated
by it; then pieces go, largest first, to the lightest fragment.

Schedule: fragment p first syncs after ``H·(p+1)/P`` inner steps, then H steps after its previous round ended, so the
fragments' rounds are spread over the period and the peak traffic is about 1/P of a full sync. :func:`due_fragments`
begins no more rounds than the in-flight bound leaves free: a due fragment waits (and keeps accumulating steps) until a
slot frees.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """Rows ``start:stop`` (dim 0) of parameter ``index``; a 0-d parameter is one piece with rows 0:1."""

    index: int
    start: int
    stop: int


@dataclass(frozen=True)
class Fragment:
    number: int
    pieces: tuple[Piece, ...]
    numel: int

    @property
    def tensor_indices(self) -> list[int]:
        """The parameters that hold the fragment's pieces, by position."""
        return sorted({piece.index for piece in self.pieces})


def _row_numel(shape: torch.Size | Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) > 0 else 1


def _rows(shape: torch.Size | Sequence[int]) -> int:
    return shape[0] if len(shape) > 0 else 1


def partition(shapes: Sequence[torch.Size | Sequence[int]], count: int) -> list[Fragment]:
    """Split parameters of ``shapes`` into ``count`` fragments (see the module docstring).

    Raises ValueError when ``count`` < 1, there is nothing to split, or ``count`` exceeds the number of rows available
    (some fragment would be empty).
    """
    if count < 1:
        raise ValueError(f"the number of fragments must be at least 1, got {count}")
    total = sum(_rows(shape) * _row_numel(shape) for shape in shapes)
    if total == 0:
        raise ValueError("there are no parameter elements to split into fragments")
    largest_piece = total if count == 1 else max(1, total // (2 * count))  # one fragment: whole tensors
    pieces: list[tuple[int, Piece]] = []
    for index, shape in enumerate(shapes):
        rows, row_numel = _rows(shape), _row_numel(shape)
        if rows * row_numel == 0:
            continue
        block = max(1, largest_piece // row_numel)
        for start in range(0, rows, block):
            stop = min(rows, start + block)
            pieces.append(((stop - start) * row_numel, Piece(index, start, stop)))
    if len(pieces) < count:
        raise ValueError(f"the model has too few rows ({len(pieces)} pieces) for {count} fragments")
    loads = [0] * count
    assigned: list[list[Piece]] = [[] for _ in range(count)]
    for numel, piece in sorted(pieces, key=lambda item: (-item[0], item[1].index, item[1].start)):
        lightest = min(range(count), key=lambda number: (loads[number], number))
        loads[lightest] += numel
        assigned[lightest].append(piece)
    return [
        Fragment(number, tuple(sorted(members, key=lambda piece: (piece.index, piece.start))), loads[number])
        for number, members in enumerate(assigned)
    ]


def views(tensors: Sequence[torch.Tensor], fragment: Fragment) -> list[torch.Tensor]:
    """The fragment's pieces of ``tensors`` as views (writing to them writes to ``tensors``)."""
    return [_as_rows(tensors[piece.index])[piece.start : piece.stop] for piece in fragment.pieces]


def copies(tensors: Sequence[torch.Tensor], fragment: Fragment) -> list[torch.Tensor]:
    """The fragment's pieces of ``tensors`` as new CPU fp32 tensors."""
    return [view.detach().to(device="cpu", dtype=torch.float32, copy=True) for view in views(tensors, fragment)]


@torch.no_grad()
def assign(tensors: Sequence[torch.Tensor], fragment: Fragment, values: Sequence[torch.Tensor]) -> None:
    """Write ``values`` (one per piece, shaped like :func:`views`) into the fragment's pieces of ``tensors``, in
    place, converting device and dtype. Raises ValueError for a wrong count or shape."""
    targets = views(tensors, fragment)
    if len(targets) != len(values):
        raise ValueError(f"fragment {fragment.number} has {len(targets)} pieces, got {len(values)} values")
    for target, value in zip(targets, values):
        if target.shape != value.shape:
            raise ValueError(f"piece shape {tuple(target.shape)} differs from value shape {tuple(value.shape)}")
        target.copy_(value.to(device=target.device, dtype=target.dtype))


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(1) if tensor.dim() == 0 else tensor


def first_round_offset(fragment: int, count: int, inner_steps: int) -> int:
    """Inner steps before fragment ``fragment`` of ``count`` first syncs: H·(fragment+1)/count, at least 1."""
    return max(1, round(inner_steps * (fragment + 1) / count))


def due_fragments(
    steps_since_round: Sequence[int], busy: Collection[int], free: int, inner_steps: Sequence[int]
) -> list[int]:
    """Fragments whose round should begin now: at least their ``inner_steps`` steps since their last round, not
    ``busy`` (with a round in flight), most overdue first (ties: lower number), and at most ``free`` of them (the slots
    the in-flight bound leaves)."""
    waiting = [number for number, steps in enumerate(steps_since_round)
               if steps >= inner_steps[number] and number not in busy]  # fmt: skip
    waiting.sort(key=lambda number: (-steps_since_round[number], number))
    return waiting[: max(0, free)]
