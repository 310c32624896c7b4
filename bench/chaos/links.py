"""Bytes that crossed each node's link during a run: a background sampler of interface counters writing JSONL, and
pure functions that turn the samples into bytes per time window and peak rates."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Protocol

from bench.events import LinkBytes
from p2p_diloco.unit.events import read_events
from p2p_diloco.unit.metrics import MetricsLog

logger = logging.getLogger(__name__)


class ByteCounters(Protocol):
    def interface_bytes(self, node: str) -> tuple[int, int]:
        """Cumulative ``(tx_bytes, rx_bytes)`` of ``node``'s link."""


class LinkMonitor:
    """Context manager: while entered, one thread samples ``counters.interface_bytes`` of every node in ``nodes``
    every ``interval_s`` (and once more on exit) and appends a ``link_bytes`` event (``bench/events.py``) per node to
    ``path``, which is opened for appending on construction. A failed sample is logged and
    skipped; the thread is stopped and joined on exit. Raises ValueError for an ``interval_s`` that is not positive."""

    def __init__(self, counters: ByteCounters, nodes: list[str], path: Path, interval_s: float = 0.5):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.counters, self.nodes, self.path, self.interval_s = counters, list(nodes), Path(path), interval_s
        self._stop = threading.Event()
        self._log = MetricsLog(self.path)
        self._thread = threading.Thread(target=self._run, name="link-monitor", daemon=True)

    def __enter__(self) -> LinkMonitor:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._log.close()

    def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            self._sample_all()
            next_at = max(next_at + self.interval_s, time.monotonic())  # a slow sample delays, never bunches, the next
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                self._sample_all()
                return

    def _sample_all(self) -> None:
        for node in self.nodes:
            try:
                tx_bytes, rx_bytes = self.counters.interface_bytes(node)
                self._log.write(LinkBytes(node=node, tx_bytes=tx_bytes, rx_bytes=rx_bytes))
            except Exception as error:  # a lost sample must never end the run
                logger.warning("link counters of %s not sampled: %s", node, error)


def read_samples(path: Path) -> list[LinkBytes]:
    """The link samples in a :class:`LinkMonitor` file (other events skipped); empty if there is no file."""
    return read_events(path, LinkBytes)


def bytes_between(samples: Iterable[LinkBytes], node: str, start: float, end: float) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of ``node`` between unix times ``start`` and ``end``, from its cumulative counters
    interpolated linearly between samples; the parts of the window outside the sampled span count nothing. Raises
    ValueError when ``end < start`` or ``node`` has no samples."""
    if end < start:
        raise ValueError(f"end {end} is before start {start}")
    points = _points(samples, node)
    if not points:
        raise ValueError(f"no link samples for {node!r}")
    (tx_start, rx_start), (tx_end, rx_end) = _counters_at(points, start), _counters_at(points, end)
    return round(tx_end - tx_start), round(rx_end - rx_start)


def peak_rate_bps(
    samples: Iterable[LinkBytes], node: str, window_s: float = 1.0, start: float | None = None, end: float | None = None
) -> float:
    """Highest rate of ``node``'s link, in bits/s, sent or received, over the windows that run from a sample to the
    first later sample at least ``window_s`` after it (only samples at unix times within [start, end] are used).
    Raises ValueError for a ``window_s`` that is not positive or when no such window exists."""
    if not window_s > 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    points = [
        point
        for point in _points(samples, node)
        if (start is None or point[0] >= start) and (end is None or point[0] <= end)
    ]
    peak: float | None = None
    later = 0
    for time_0, tx_0, rx_0 in points:
        while later < len(points) and points[later][0] - time_0 < window_s:
            later += 1
        if later == len(points):
            break
        time_1, tx_1, rx_1 = points[later]
        rate = max(tx_1 - tx_0, rx_1 - rx_0) * 8 / (time_1 - time_0)
        peak = rate if peak is None else max(peak, rate)
    if peak is None:
        raise ValueError(f"no window of {window_s} s between the link samples of {node!r}")
    return peak


def _points(samples: Iterable[LinkBytes], node: str) -> list[tuple[float, int, int]]:
    """``(time, tx_bytes, rx_bytes)`` of ``node``'s samples, sorted by time."""
    return sorted((sample.time, sample.tx_bytes, sample.rx_bytes) for sample in samples if sample.node == node)


def _counters_at(points: list[tuple[float, int, int]], when: float) -> tuple[float, float]:
    """Counters at ``when``, interpolated between the samples around it; clamped to the first and last sample."""
    if when <= points[0][0]:
        return float(points[0][1]), float(points[0][2])
    for (time_0, tx_0, rx_0), (time_1, tx_1, rx_1) in zip(points, points[1:]):
        if when <= time_1:
            weight = (when - time_0) / (time_1 - time_0)
            return tx_0 + weight * (tx_1 - tx_0), rx_0 + weight * (rx_1 - rx_0)
    return float(points[-1][1]), float(points[-1][2])
