"""Bytes that a unit's p2p daemons really sent and received over TCP, from the kernel's socket statistics.

All of a unit's traffic (DHT, matchmaking, all-reduce, state downloads) goes through the ``p2pd`` daemons that
hivemind starts as descendants of the unit's process. :class:`WireCounter` reads their TCP sockets' cumulative
``bytes_sent`` / ``bytes_received`` with ``ss`` (iproute2) and keeps the last value seen per socket, so
connections that close between two samples still count up to their last sample. Where ``ss`` is missing the
counter reports None ("not measured") rather than a guess.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from p2p_diloco.lifecycle import descendant_pids

logger = logging.getLogger(__name__)

_OWNER = re.compile(r'\("p2pd",pid=(\d+),')
_INODE = re.compile(r"\bino:(\d+)")
_SENT = re.compile(r"\bbytes_sent:(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


@dataclass(frozen=True)
class WireBytes:
    sent: int
    received: int


def parse_socket_stats(output: str, pids: set[int]) -> dict[str, WireBytes]:
    """Per-socket (by inode) byte counters of the TCP sockets owned by ``pids`` in ``ss -tinpeH`` output."""
    counters: dict[str, WireBytes] = {}
    lines = output.splitlines()
    for header, details in zip(lines, lines[1:]):
        owner, inode = _OWNER.search(header), _INODE.search(header)
        if owner is None or inode is None or int(owner.group(1)) not in pids or header.startswith("\t"):
            continue
        sent, received = _SENT.search(details), _RECEIVED.search(details)
        counters[inode.group(1)] = WireBytes(
            int(sent.group(1)) if sent else 0, int(received.group(1)) if received else 0
        )
    return counters


class WireCounter:
    """Cumulative TCP bytes of the p2pd daemons below process ``root_pid`` (default: this process)."""

    def __init__(self, root_pid: int | None = None):
        self.root_pid = root_pid if root_pid is not None else os.getpid()
        self._ss = shutil.which("ss")
        self._per_socket: dict[str, WireBytes] = {}

    def sample(self) -> WireBytes | None:
        """Totals so far, or None when they cannot be measured here (no ``ss``, or it failed)."""
        if self._ss is None:
            return None
        pids = {pid for pid in descendant_pids(self.root_pid) if _is_p2pd(pid)}
        try:
            output = subprocess.run(
                [self._ss, "-tinpeH"], capture_output=True, text=True, timeout=10, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError) as error:
            logger.warning("socket statistics unavailable: %s", error)
            return None
        for inode, counters in parse_socket_stats(output, pids).items():
            previous = self._per_socket.get(inode, WireBytes(0, 0))
            self._per_socket[inode] = WireBytes(
                max(previous.sent, counters.sent), max(previous.received, counters.received)
            )
        return WireBytes(
            sum(counters.sent for counters in self._per_socket.values()),
            sum(counters.received for counters in self._per_socket.values()),
        )

    def event_fields(self) -> dict[str, int | None]:
        """:meth:`sample` as an event's ``wire_bytes_sent`` and ``wire_bytes_received`` (None: not measurable)."""
        totals = self.sample()
        return {
            "wire_bytes_sent": totals.sent if totals else None,
            "wire_bytes_received": totals.received if totals else None,
        }


def _is_p2pd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd"
    except OSError:
        return False
