"""What a learning unit reports: a JSONL event log, console progress bars, throughput and log format."""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

from p2p_diloco.unit.events import Event

_LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
_LOG_DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"
_HANDLER_NAME = "p2p_diloco"


class MetricsLog:
    """Append-only JSONL file of events (p2p_diloco/events.py), one object per line.

    Lines are flushed as written (a killed process loses at most the line being written), writes from
    several threads do not interleave, and non-finite floats are written as ``null`` so every line is
    strict JSON. Writing after :meth:`close` raises ValueError.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, event: Event) -> None:
        """Append one event."""
        fields = {name: _finite(value) for name, value in event.fields().items()}
        line = json.dumps({"time": event.time, "event": event.event, **fields}, allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        """Close the file; idempotent."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _finite(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class ProgressBars:
    """Two console bars on ``stream``: inner steps (postfix: loss, tokens/s) and the unit's outer rounds (postfix:
    group size, eval loss); the log lines of :func:`configure_logging` are written above them.

    Bars are drawn only when ``enabled`` and ``stream`` is a terminal (redraws would fill a log file or
    ``docker logs``); otherwise every method is a no-op.
    """

    def __init__(self, total_inner_steps: int | None, enabled: bool, stream: TextIO | None = None):
        stream = stream or sys.stderr
        self._inner: tqdm | None = None
        self._outer: tqdm | None = None
        self._eval_loss: float | None = None
        if enabled and stream.isatty():
            self._inner = tqdm(total=total_inner_steps, desc="inner steps", unit="step", position=0,
                               dynamic_ncols=True, file=stream)  # fmt: skip
            self._outer = tqdm(desc="outer rounds", unit="round", position=1, dynamic_ncols=True, file=stream)

    def inner_step(self, loss: float, tokens_per_s: float) -> None:
        """Advance the inner-step bar by one."""
        if self._inner is not None:
            self._inner.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
            self._inner.update(1)

    def outer_round(self, unit_round: int, group_size: int, eval_loss: float | None) -> None:
        """Show the unit's outer round (the metrics' ``unit_outer_round``: with fragments, one per P fragment
        rounds); ``eval_loss`` None keeps the last one shown."""
        if self._outer is not None:
            self._eval_loss = eval_loss if eval_loss is not None else self._eval_loss
            postfix: dict[str, int | str] = {"group": group_size}
            if self._eval_loss is not None:
                postfix["eval_loss"] = f"{self._eval_loss:.4f}"
            self._outer.set_postfix(postfix, refresh=False)
            self._outer.update(unit_round - self._outer.n)

    def close(self) -> None:
        """Close both bars; idempotent."""
        for bar in (self._inner, self._outer):
            if bar is not None:
                bar.close()


STEP_WINDOW = 16  # the inner-step periods whose median is the step time that rounds are scheduled by


@dataclass
class Throughput:
    """Exponential moving averages of tokens per inner step and seconds per inner step (the throughput a unit reports),
    and the median of the last STEP_WINDOW step periods (the step time its rounds are scheduled by).

    ``smoothing`` is the weight of the newest sample (1 = no averaging); the first sample is taken as is.
    """

    smoothing: float = 0.1
    _tokens: float | None = field(default=None, init=False, repr=False)
    _seconds: float | None = field(default=None, init=False, repr=False)
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW), init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def add(self, tokens: int, seconds: float) -> None:
        """Record one step. Raises ValueError for negative tokens or non-positive/non-finite seconds."""
        if tokens < 0 or not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"need tokens >= 0 and finite seconds > 0, got tokens={tokens}, seconds={seconds}")
        if self._tokens is None or self._seconds is None:
            self._tokens, self._seconds = float(tokens), seconds
        else:
            self._tokens += self.smoothing * (tokens - self._tokens)
            self._seconds += self.smoothing * (seconds - self._seconds)
        self._recent.append(seconds)

    @property
    def tokens_per_s(self) -> float | None:
        """Averaged tokens / averaged seconds; None before the first sample."""
        if self._tokens is None or self._seconds is None:
            return None
        return self._tokens / self._seconds

    @property
    def step_time_s(self) -> float | None:
        """The median of the last STEP_WINDOW inner-step periods (sizes the round period, windows and timeouts); None
        before the first sample. One step stalled for seconds (a stopped process, swapping) does not move it: with the
        moving average, a unit frozen for 30 s wanted a 64-s period and the census carried it to the whole swarm,
        which then went a minute without a round (tests/test_chaos_swarm.py's frozen unit, once in a whole suite)."""
        return statistics.median(self._recent) if self._recent else None


class _AboveBars(logging.StreamHandler):
    """Writes each record through ``tqdm.write``: a line goes above the progress bars instead of through them."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def configure_logging(level: str = "INFO") -> None:
    """Log ``time level name: message`` lines to stderr through the root logger at ``level``, above any progress
    bars.

    hivemind's own handler is detached so its records go through the same root handler, and the
    ``hivemind`` loggers are held at WARNING unless ``level`` is DEBUG. Calling again replaces the
    handler installed by the previous call. Raises ValueError for an unknown level name.
    """
    numeric_level = _numeric(level)
    from hivemind.utils.logging import use_hivemind_log_handler  # importing hivemind installs its handler
    from transformers.utils import logging as transformers_logging

    use_hivemind_log_handler("nowhere")
    root = logging.getLogger()
    _replace_handler(root, numeric_level)
    root.setLevel(numeric_level)
    hivemind_level = logging.NOTSET if numeric_level <= logging.DEBUG else max(numeric_level, logging.WARNING)
    logging.getLogger("hivemind").setLevel(hivemind_level)
    logging.getLogger("hivemind.averaging.averager").addFilter(_drop_expected_solo_rounds)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # its save/load bars would cut through the log


def configure_library_logging(level: str | None = "INFO") -> None:
    """The console of a unit run through the library (api.py): the ``p2p_diloco`` loggers at ``level``, so that the
    CLI's INFO lines (join, each round, evals, leave) show under a script's own logging set-up, whose root logger
    usually stays at WARNING (``logging.basicConfig``); a handler of this module's format is added to ``p2p_diloco``
    only when no handler would write its lines. hivemind's errors for a round nobody else joined are dropped, as the
    CLI drops them. ``level`` "WARNING" silences the lines; None leaves logging as the caller set it. Raises
    ValueError for an unknown level name."""
    if level is None:
        return
    numeric_level = _numeric(level)
    library = logging.getLogger("p2p_diloco")
    library.setLevel(numeric_level)
    if not library.hasHandlers() or any(handler.get_name() == _HANDLER_NAME for handler in library.handlers):
        _replace_handler(library, logging.NOTSET)
    logging.getLogger("hivemind.averaging.averager").addFilter(_drop_expected_solo_rounds)


def _numeric(level: str) -> int:
    numeric_level = logging.getLevelNamesMapping().get(level.upper())
    if numeric_level is None:
        raise ValueError(f"unknown log level {level!r}")
    return numeric_level


def _replace_handler(logger: logging.Logger, level: int) -> None:
    """``logger``'s handler of this module (the one a previous call added, if any) replaced by a new one."""
    for handler in [handler for handler in logger.handlers if handler.get_name() == _HANDLER_NAME]:
        logger.removeHandler(handler)
    handler = _AboveBars(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT, datefmt=_LOG_DATE_FORMAT))
    handler.setLevel(level)
    logger.addHandler(handler)


def _drop_expected_solo_rounds(record: logging.LogRecord) -> bool:
    """hivemind logs a traceback at ERROR when nobody joined a round; for a unit alone that is expected."""
    return "could not find a group" not in record.getMessage()
