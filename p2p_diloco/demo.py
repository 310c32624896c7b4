"""The embedded default: a bootstrap node and N learning units on 127.0.0.1, each a separate OS process.

Every unit pre-trains the small GPT-2 shipped in ``assets/tiny-gpt2`` on the shipped Moby Dick corpus for a
bounded time; the summary reads each unit's metrics.jsonl. Nothing but localhost is reached.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).parent / "assets"
TINY_MODEL = ASSETS / "tiny-gpt2"
CORPUS = ASSETS / "corpus"
BOOTSTRAP_TIMEOUT_S = 60.0


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


def peer_command(initial_peer: str, work_dir: Path, duration_s: float, run_id: str = "demo") -> list[str]:
    """The ``p2p-diloco join`` command line of one demo unit (later flags override earlier ones)."""
    return [
        sys.executable,
        "-m",
        "p2p_diloco.cli",
        "join",
        "--run-id",
        run_id,
        "--initial-peers",
        initial_peer,
        "--model-config",
        str(TINY_MODEL),
        "--dataset",
        str(CORPUS),
        "--seq-len",
        "64",
        "--batch-size",
        "8",
        "--inner-lr",
        "3e-3",
        "--inner-steps",
        "20",
        "--max-time-s",
        str(duration_s),
        "--work-dir",
        str(work_dir),
        "--save-dir",
        str(work_dir / "model"),
        "--threads",
        "1",
        "--no-progress",
    ]


def bootstrap_command(
    work_dir: Path, initial_peers: tuple[str, ...] = (), host: str = "127.0.0.1", port: int = 0
) -> list[str]:
    """The ``p2p-diloco bootstrap`` command line listening on ``host``:``port`` (0: any free port). Its identity is
    kept in ``work_dir``, so a restart on the same port serves the same multiaddr."""
    command = [
        sys.executable,
        "-m",
        "p2p_diloco.cli",
        "bootstrap",
        "--identity-path",
        str(work_dir / "bootstrap.key"),
        "--host-maddrs",
        f"/ip4/{host}/tcp/{port}",
    ]
    return command + (["--initial-peers", *initial_peers] if initial_peers else [])


def start_bootstrap(
    work_dir: Path,
    initial_peers: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    port: int = 0,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start :func:`bootstrap_command` and return it with the first multiaddr it prints. ``wrap`` turns the command
    into one that runs elsewhere (e.g. in a network namespace)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    command = bootstrap_command(work_dir, initial_peers, host, port)
    process = spawn(wrap(command) if wrap else command, work_dir / "bootstrap.log", stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        for word in line.split():
            if word.startswith(f"/ip4/{host}/") and "/p2p/" in word:
                return process, word
    stop_process_groups([process])
    raise RuntimeError(f"the bootstrap node printed no multiaddr; see {work_dir / 'bootstrap.log'}")


def spawn(command: list[str], log_path: Path, **popen_kwargs: Any) -> subprocess.Popen:
    """Start ``command`` in a new session (its own process group) with stderr, and stdout unless redirected
    by ``popen_kwargs``, appended to ``log_path``."""
    with open(log_path, "a") as log:
        popen_kwargs.setdefault("stdout", log)
        stderr = subprocess.STDOUT if popen_kwargs["stdout"] is log else log
        return subprocess.Popen(command, stderr=stderr, start_new_session=True, **popen_kwargs)


def stop_process_groups(processes: list[subprocess.Popen], grace_s: float = 20.0) -> list[int]:
    """SIGTERM every process's group at once, wait up to ``grace_s`` in all, then SIGKILL the groups still
    there; returns the exit codes in order."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return [process.wait() for process in processes]


def summarize(name: str, metrics_path: Path, exit_code: int | None) -> PeerSummary:
    """Aggregate one unit's metrics.jsonl."""
    events = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    evals = [event["eval_loss"] for event in events if event["event"] == "eval"]
    rounds = [event for event in events if event["event"] == "outer_round"]
    stops = [event for event in events if event["event"] == "stop"]
    return PeerSummary(
        name=name,
        exit_code=exit_code,
        eval_before=evals[0] if evals else None,
        eval_after=evals[-1] if evals else None,
        outer_rounds=len(rounds),
        mean_group_size=sum(event["group_size"] for event in rounds) / len(rounds) if rounds else 0.0,
        bytes_sent=stops[-1].get("wire_bytes_sent") if stops else None,
        inner_steps=stops[-1]["inner_step"] if stops else 0,
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


def run_demo(peers: int, duration_s: float, work_dir: Path) -> int:
    """Run the local swarm in a new ``run-<time>-<pid>`` folder of ``work_dir`` (earlier runs are kept and never
    resumed) and print its summary. Exit code 0 when every unit exited 0, groups of several units formed and
    every unit's consensus eval loss fell; 1 otherwise. Every process is stopped on exit."""
    work_dir = Path(work_dir) / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    bootstrap, maddr = start_bootstrap(work_dir)
    print(f"bootstrap node up: {maddr}", flush=True)
    units: list[subprocess.Popen] = []
    try:
        for index in range(peers):
            unit_dir = work_dir / f"peer{index}"
            unit_dir.mkdir(parents=True, exist_ok=True)
            units.append(spawn(peer_command(maddr, unit_dir, duration_s), unit_dir / "stdout.log"))
        print(f"{peers} learning units training for {duration_s:.0f} s (logs in {work_dir}/peer*/)", flush=True)
        deadline = time.monotonic() + duration_s + 180.0
        while time.monotonic() < deadline and any(unit.poll() is None for unit in units):
            time.sleep(1.0)
    finally:
        exit_codes = stop_process_groups(units)
        stop_process_groups([bootstrap])
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
