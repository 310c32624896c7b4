"""The demo: a bootstrap node and N learning units on 127.0.0.1, each a separate OS process.

Every unit trains the tiny preset (presets.py: the small GPT-2 and the Moby Dick corpus shipped in ``assets/``) for a
bounded time; the summary reads each unit's metrics.jsonl. Nothing but localhost is reached.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from p2p_diloco.ops.launcher import join_command, spawn, start_bootstrap, stop_process_groups
from p2p_diloco.unit.events import Eval, OuterRound, Stop, read_events


@dataclass
class PeerSummary:
    name: str
    exit_code: int | None
    eval_before: float | None
    eval_after: float | None
    outer_rounds: int
    mean_group_size: float
    bytes_sent: int | None
    inner_steps: int


def summarize(name: str, metrics_path: Path, exit_code: int | None) -> PeerSummary:
    """Aggregate one unit's metrics.jsonl."""
    evals = [event.eval_loss for event in read_events(metrics_path, Eval)]
    rounds = read_events(metrics_path, OuterRound)
    stops = read_events(metrics_path, Stop)
    return PeerSummary(
        name=name,
        exit_code=exit_code,
        eval_before=evals[0] if evals else None,
        eval_after=evals[-1] if evals else None,
        outer_rounds=len(rounds),
        mean_group_size=sum(event.group_size for event in rounds) / len(rounds) if rounds else 0.0,
        bytes_sent=stops[-1].wire_bytes_sent if stops else None,
        inner_steps=stops[-1].inner_step if stops else 0,
    )


def format_summary(summaries: list[PeerSummary]) -> str:
    def loss(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    lines = [
        "| peer | exit | inner steps | outer rounds | mean group size "
        "| eval loss before | eval loss after | MiB sent on the wire |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for summary in summaries:
        lines.append(
            f"| {summary.name} | {summary.exit_code} | {summary.inner_steps} | {summary.outer_rounds} | "
            f"{summary.mean_group_size:.2f} | {loss(summary.eval_before)} | {loss(summary.eval_after)} | "
            f"{'not measured' if summary.bytes_sent is None else f'{summary.bytes_sent / 2**20:.1f}'} |"
        )
    return "\n".join(lines)


@dataclass
class RoundLog:
    """Echoes the round, eval and leave lines (tracking.py's) a unit wrote to its log since the last call."""

    name: str
    path: Path
    offset: int = 0

    def echo(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as file:
            file.seek(self.offset)
            chunk = file.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next call
        self.offset += len(complete)
        for line in complete.decode("utf-8", errors="replace").splitlines():
            if " p2p_diloco.unit.tracking: " in line:
                print(f"{self.name}  {line.split(' p2p_diloco.unit.tracking: ', 1)[1]}", flush=True)


def run_demo(peers: int, duration_s: float, work_dir: Path) -> int:
    """Run the local swarm in a new ``run-<time>-<pid>`` folder of ``work_dir`` (earlier runs are kept and never
    resumed) and print its summary. Exit code 0 when every unit exited 0, groups of several units formed and
    every unit's consensus eval loss fell; 1 otherwise. Every process is stopped on exit."""
    work_dir = Path(work_dir) / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    threads = max(1, (os.cpu_count() or 1) // peers)  # the units share this machine's cores
    bootstrap, maddr = start_bootstrap(work_dir)
    print(f"bootstrap node up: {maddr}", flush=True)
    units: list[subprocess.Popen] = []
    logs = [RoundLog(f"peer{index}", work_dir / f"peer{index}" / "stdout.log") for index in range(peers)]
    try:
        for index in range(peers):
            unit_dir = work_dir / f"peer{index}"
            unit_dir.mkdir(parents=True, exist_ok=True)
            command = [*join_command([maddr], unit_dir, duration_s, run_id="demo"), "--threads", str(threads)]
            units.append(spawn(command, unit_dir / "stdout.log"))
        print(f"{peers} learning units training for {duration_s:.0f} s (logs in {work_dir}/peer*/)", flush=True)
        deadline = time.monotonic() + duration_s + 180.0
        while time.monotonic() < deadline and any(unit.poll() is None for unit in units):
            time.sleep(1.0)
            for log in logs:
                log.echo()
    finally:
        exit_codes = stop_process_groups(units)
        stop_process_groups([bootstrap])
        for log in logs:
            log.echo()
    summaries = [
        summarize(f"peer{index}", work_dir / f"peer{index}" / "metrics.jsonl", code)
        for index, code in enumerate(exit_codes)
    ]
    table = format_summary(summaries)
    print(table)
    (work_dir / "summary.md").write_text(table + "\n")
    ok = all(
        summary.exit_code == 0
        and summary.eval_before is not None
        and summary.eval_after is not None
        and summary.eval_after < summary.eval_before
        for summary in summaries
    ) and (peers == 1 or any(summary.mean_group_size > 1 for summary in summaries))
    print("demo " + ("succeeded" if ok else "FAILED") + f"; consensus models exported to {work_dir}/peer*/model")
    return 0 if ok else 1
