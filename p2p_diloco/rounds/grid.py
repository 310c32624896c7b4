"""Grid groups: where each unit meets the others at one boundary of shared time (torch-free, no I/O).

Every unit derives the same layout from the same census (the peer ids of the live units, itself included) and the
round's ``salt`` (its fragment and boundary, the same for every unit at that boundary):

* the units, ordered by a hash of (salt, peer id): drawn anew every round, so no unit keeps its neighbours and
  information crosses rows; then dealt in turn to R = ceil(N / target) rows, so rows differ by at most one unit and
  hold at most ``target`` units;
* stage 1, the fragment round: a row meets under its own group key (hivemind's group bits), so only its members
  compete in its matchmaking, and the row's first unit in the order leads it (it schedules the round first; the
  others one ``SPACING_S`` apart, in order, so every member asks the same leader first and the next one leads if
  it is absent). A unit asks the units before it in its row to lead at once, without waiting for hivemind's DHT
  lookup to show them (``row_leaders``): with 16 units on one machine, members whose lookup did not return before
  the boundary asked nobody and ended the round alone;
* stage 2, the mix round (clock.py, half a period later): C = N // R columns (the smallest row's size); the unit at
  place p of its row joins column p mod C, carrying its row's total weight divided by k, the number of its row's
  units in that column. Every column then holds every row's mean exactly once in weight, so every unit ends the
  period on the weighted mean of all N proposals: synchronous DiLoCo's φ. A column holds R units and one more for
  each row of more than C units (at most 2R − 1, so a column may exceed ``target`` when N > target²).

With N ≤ target there is one row, no group bits and no mix round. A unit whose census differs from the others'
(a join or a departure not yet read) may land in another row than the others place it in: that round merges fewer
units, and the next round's draw brings it back (a merge of fp32 proposals catches a unit up in one round).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

SPACING_S = 0.05  # between the scheduled times of consecutive units of one group (the leader's first)


@dataclass(frozen=True)
class Leader:
    """A unit expected to lead a group this unit joins, and when it schedules its round, relative to this unit
    (seconds, at most 0)."""

    peer_id: str
    offset_s: float


@dataclass(frozen=True)
class GridCell:
    """One unit's place in a round's layout (see the module docstring)."""

    count: int  # N
    rows: int  # R
    row: int
    place: int  # in its row's order: 0 leads stage 1
    row_size: int
    columns: int  # C (0 with one row: no stage 2)
    column_share: float  # 1 / k: what part of its row's weight the unit carries into its column
    members: tuple[str, ...] = ()  # the layout's units in the round's order (unit i: row i mod R, place i // R)

    @property
    def row_bits(self) -> str:
        """The stage-1 group bits ("" with one row)."""
        return "" if self.rows == 1 else "0" + _bits(self.row, self.rows)

    @property
    def column(self) -> int:
        return self.place % self.columns if self.columns else 0

    @property
    def column_bits(self) -> str:
        """The stage-2 group bits ("" with one row)."""
        return "" if self.rows == 1 else "1" + _bits(self.column, self.columns)

    @property
    def column_size(self) -> int:
        """The units of this unit's column (each row's units at places ≡ the column mod C)."""
        if not self.columns:
            return self.row_size
        sizes = [len(range(row, self.count, self.rows)) for row in range(self.rows)]
        return sum(len(range(self.column, size, self.columns)) for size in sizes)

    @property
    def row_members(self) -> tuple[str, ...]:
        """The units of this unit's row, in the round's order."""
        return self.members[self.row :: self.rows]

    @property
    def column_members(self) -> tuple[str, ...]:
        """The units of this unit's column (its row's without a stage 2), row by row."""
        if not self.columns:
            return self.row_members
        return tuple(self.members[row + place * self.rows] for row in range(self.rows)
                     for place in range(self.column, len(range(row, self.count, self.rows)), self.columns))  # fmt: skip

    @property
    def row_leaders(self) -> tuple[Leader, ...]:
        """The units of this unit's row scheduled before it (earlier places), earliest first: those it asks to lead
        its stage-1 round, in that order."""
        row = self.row_members
        return tuple(Leader(peer, (place - self.place) * SPACING_S) for place, peer in enumerate(row[: self.place]))

    @property
    def column_leaders(self) -> tuple[Leader, ...]:
        """The units of this unit's column in earlier rows, earliest first (stage 2; units of one row in one column
        schedule together, and hivemind orders them by peer id)."""
        if not self.columns:
            return ()
        earlier = [(row, place) for row in range(self.row) for place in range(self.column, len(range(row, self.count,
                   self.rows)), self.columns)]  # fmt: skip
        return tuple(Leader(self.members[row + place * self.rows], (row - self.row) * SPACING_S)
                     for row, place in earlier)  # fmt: skip

    @property
    def row_offset_s(self) -> float:
        """How long after the boundary this unit schedules its stage-1 round."""
        return self.place * SPACING_S

    @property
    def column_offset_s(self) -> float:
        """How long after its boundary this unit schedules its stage-2 round (the unit of row 0 leads a column)."""
        return self.row * SPACING_S


def grid_cell(census: Iterable[str], peer_id: str, salt: str, target: int) -> GridCell:
    """``peer_id``'s cell in the layout of ``census`` (``peer_id`` counted whether or not it is listed) for ``salt``
    with rows of at most ``target`` units. Raises ValueError for a target below 1."""
    if target < 1:
        raise ValueError(f"a row holds at least one unit, got a target of {target}")
    members = sorted(set(census) | {peer_id}, key=lambda peer: hashlib.sha256(f"{salt}/{peer}".encode()).digest())
    count = len(members)
    rows = math.ceil(count / target)
    index = members.index(peer_id)
    row, place = index % rows, index // rows
    row_size = len(range(row, count, rows))
    columns = count // rows if rows > 1 else 0
    in_column = len(range(place % columns, row_size, columns)) if columns else 1
    return GridCell(count, rows, row, place, row_size, columns, 1.0 / in_column, tuple(members))


def _bits(value: int, count: int) -> str:
    """``value`` in binary, as wide as ``count - 1`` needs (at least one bit)."""
    return format(value, f"0{max(1, (count - 1).bit_length())}b")
