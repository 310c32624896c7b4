"""Goodput of one learning unit: inner-step compute whose result reached the consensus model, per allocated peer-time.

An inner step's compute becomes useful when the pseudo-gradient that carries it is merged by a successful outer
round. Allocated time runs from the first start of the unit's work directory, so the downtime after a crash counts
as allocated but not useful. The ledger lives in ``work_dir/goodput.json`` (a few hundred bytes, written atomically).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import IO, Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from p2p_diloco.checkpoint import atomic_write
from p2p_diloco.errors import first_line

logger = logging.getLogger(__name__)

LEDGER_FILE = "goodput.json"

_Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
_Count = Annotated[int, Field(ge=0)]


class GoodputLedger(BaseModel):
    """Cumulative compute and allocation of one work directory, across every start of a unit on it."""

    model_config = ConfigDict(extra="forbid")

    allocated_since: _Seconds  # unix time of the first start on this work directory
    starts: _Count = 0
    compute_s: _Seconds = 0.0  # every inner step's compute
    useful_compute_s: _Seconds = 0.0  # compute of the inner steps merged by a successful outer round
    tokens: _Count = 0
    useful_tokens: _Count = 0

    @classmethod
    def load_or_create(cls, path: Path, now: float | None = None) -> GoodputLedger:
        """The ledger at ``path`` with this start counted in ``starts``, saved back at once (so the first start's
        time survives a crash before any round). A missing file gives a fresh ledger allocated since ``now``
        (default: the current unix time); an unreadable or invalid file logs a warning and gives a fresh one too
        (its history is lost). Raises OSError when the ledger cannot be written."""
        now = time.time() if now is None else now
        try:
            ledger = cls.model_validate_json(Path(path).read_bytes())
        except FileNotFoundError:
            ledger = cls(allocated_since=now)
        except (OSError, ValidationError) as error:
            logger.warning("goodput ledger unreadable, starting a fresh one path=%s error=%s", path, first_line(error))
            ledger = cls(allocated_since=now)
        ledger.starts += 1
        ledger.save(path)
        logger.info(
            "goodput ledger path=%s starts=%d allocated_s=%.1f useful_compute_s=%.1f",
            path,
            ledger.starts,
            ledger.allocated_s(now),
            ledger.useful_compute_s,
        )
        return ledger

    def record_step(self, seconds: float, tokens: int) -> None:
        """Count one inner step's compute and tokens (not yet useful)."""
        self.compute_s += seconds
        self.tokens += tokens

    def record_merge(self, seconds: float, tokens: int) -> None:
        """Count the compute and tokens of inner steps that a successful outer round merged as useful."""
        self.useful_compute_s += seconds
        self.useful_tokens += tokens

    def allocated_s(self, now: float) -> float:
        """Peer-time allocated to this work directory up to unix time ``now`` (0 if the clock is behind)."""
        return max(0.0, now - self.allocated_since)

    def goodput(self, now: float) -> float:
        """Useful compute / allocated time at unix time ``now``; 0.0 while nothing is allocated."""
        allocated = self.allocated_s(now)
        return self.useful_compute_s / allocated if allocated > 0 else 0.0

    def save(self, path: Path) -> None:
        """Atomically replace ``path`` with this ledger (see :func:`p2p_diloco.checkpoint.atomic_write`)."""
        data = self.model_dump_json(indent=1).encode()

        def write(file: IO[bytes]) -> None:
            file.write(data)

        atomic_write(path, write)
