"""What a process tree costs at one instant: each live member's memory (PSS, USS, peak RSS), threads and CPU time.

PSS (proportional set size) charges a page shared by k processes 1/k to each, so the PSS of a process tree summed
counts every page the tree holds once: the forked hivemind children's copy-on-write pages, the averagers' shared
memory and the main process's own pages alike. USS is what a process alone holds (its private pages).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.chaos import faults


@dataclass(frozen=True)
class ProcessSample:
    """One live process of a tree. ``kind``: ``main`` (the tree's root), ``rank<r>`` (a rank of a unit of several,
    started by the root: torch's launcher), ``watchdog`` (p2p_diloco.lifecycle's orphan reaper), ``forked`` (another
    Python child: hivemind's DHT and averager processes), else the program's name (e.g. ``p2pd``, libp2p's daemon, or
    ``torch_shm_manager``, which torch starts for tensors in shared memory)."""

    pid: int
    started: float  # psutil create_time: with pid, identifies the process
    kind: str
    pss: int  # bytes
    uss: int  # bytes
    rss_peak: int  # bytes: the kernel's high-water mark of the process's RSS (VmHWM), 0 when unreadable
    threads: int
    cpu_s: float  # user + system seconds so far


def sample_tree(pid: int) -> list[ProcessSample]:
    """Every live process of ``pid``'s tree (``pid`` first), processes that vanish meanwhile left out."""
    samples = []
    for member in faults.process_tree(pid):
        with contextlib.suppress(psutil.Error):
            samples.append(_sample(psutil.Process(member), root=pid))
    return samples


def _sample(process: psutil.Process, root: int) -> ProcessSample:
    with process.oneshot():
        memory = process.memory_full_info()
        times = process.cpu_times()
        return ProcessSample(
            pid=process.pid,
            started=process.create_time(),
            kind=_kind(process, root),
            pss=memory.pss,
            uss=memory.uss,
            rss_peak=_rss_high_water_mark(process.pid),
            threads=process.num_threads(),
            cpu_s=times.user + times.system,
        )


def _kind(process: psutil.Process, root: int) -> str:
    if process.pid == root:
        return "main"
    if not process.name().startswith("python"):
        return process.name()
    if "p2p_diloco.lifecycle" in process.cmdline():
        return "watchdog"
    rank = process.environ().get("RANK") if process.ppid() == root else None
    return "forked" if rank is None else f"rank{rank}"


def _rss_high_water_mark(pid: int) -> int:
    """VmHWM of /proc/PID/status in bytes (0 when unreadable)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0
