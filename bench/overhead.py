"""What a learning unit's outer machinery adds to its inner step time when the network is idle.

Two runs with the same ``p2p-diloco join`` flags (model, data pipeline, seed, threads, batch, number of steps):

* A, the bare loop: ``python -m bench.overhead FLAGS``: :meth:`InnerTrainer.train_step` over the unit's data
  pipeline (with a data order of its own: batches of the same shape), nothing else (no DHT, averager or rounds);
* B, a real lone unit: ``python -m p2p_diloco.cli join FLAGS`` without initial peers, so it runs its own DHT and its
  rounds complete alone after their matchmaking window.

Both write an ``inner_step`` event after every step to ``metrics.jsonl`` in their work dir. The metric is wall seconds
per inner step from step ``from_step`` to the last event (start-up excluded). A and the B variants alternate (reversed
order every other repeat) to cancel machine drift; a variant's overhead is the median over repeats of B / A − 1, each B
against the A of its own repeat. Where B's extra time goes: the duration of train_step itself (the logged steps'
``seconds``) against the rest of the loop, and the CPU time of the run's main process against that of its descendants
(DHT, averagers, p2pd) over the same window.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import lab_environment, module_command
from bench.training import TrainingSetup
from p2p_diloco.config import PeerConfig
from p2p_diloco.lifecycle import descendant_pids
from p2p_diloco.ops.launcher import CLI, spawn, stop_process_groups
from p2p_diloco.settings import add_config_arguments, load_config
from p2p_diloco.unit.data import load_text_data, shard_seed
from p2p_diloco.unit.events import InnerStep, OuterRound, read_events
from p2p_diloco.unit.inner import InnerTrainer
from p2p_diloco.unit.metrics import MetricsLog
from p2p_diloco.unit.model import load_model

NEVER = 10**6  # steps between evals, rounds between checkpoints: none within a measured run
RUN_TIMEOUT_S = 1800.0
POLL_S = 0.1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

VARIANTS: dict[str, tuple[str, ...]] = {
    "int8-P4": ("--fragments", "4", "--codec", "int8"),
    "fp32-P1": ("--fragments", "1", "--codec", "fp32"),
}


def bare_loop(config: PeerConfig) -> None:
    """Run A: ``config.run.max_steps`` inner steps on the unit's data pipeline, logging like a unit.

    Raises ValueError without ``max_steps``."""
    if config.run.max_steps is None:
        raise ValueError("the bare loop needs --max-steps")
    if config.run.threads is not None:
        torch.set_num_threads(config.run.threads)
    loaded = load_model(config.model)
    data = load_text_data(config.data, loaded.tokenizer, shard_seed(config.model.seed, "bare loop"))
    trainer = InnerTrainer(loaded.model, config.inner, loaded.device, loaded.autocast)
    batches = data.train_batches()
    with MetricsLog(Path(config.run.work_dir) / "metrics.jsonl") as metrics:
        for step in range(1, config.run.max_steps + 1):
            stats = trainer.train_step(batches)
            metrics.write(InnerStep(step=step, loss=stats.loss, seconds=stats.seconds, lr=stats.lr))


def shared_flags(steps: int, work_dir: Path, setup: TrainingSetup) -> list[str]:
    """The ``join`` flags both runs take: ``setup``'s training settings, one thread, ``steps`` steps, no evals or
    checkpoints in between (they are not round machinery), a run id of its own."""
    return [
        *setup.join_flags(),
        "--checkpoint-every-rounds", str(NEVER),
        "--threads", "1",
        "--max-steps", str(steps),
        "--work-dir", str(work_dir),
        "--run-id", f"overhead-{os.getpid()}",
        "--no-progress",
    ]  # fmt: skip


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds so far of each of ``pids`` that still runs."""
    found = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return found


@dataclass(frozen=True)
class Snapshot:
    """CPU seconds of a run's main process and of all its descendants at one time."""

    time: float
    main: float
    background: dict[int, float]

    @classmethod
    def take(cls, pid: int) -> Snapshot:
        main = cpu_seconds([pid]).get(pid, 0.0)
        return cls(time.monotonic(), main, cpu_seconds(descendant_pids(pid)))


@dataclass(frozen=True)
class RunTiming:
    """One run over its timed window: from the ``inner_step`` event of ``from_step`` to the last one."""

    step_s: float  # wall seconds per inner step
    train_step_s: float  # mean duration of train_step itself (the ``seconds`` of the window's logged steps)
    main_cpu_s: float  # CPU seconds per inner step of the run's main process
    background_cpu_s: float  # and of its descendants (DHT, averagers, p2pd, watchdog)
    rounds: int  # outer_round events in the window
    solo_rounds: int  # of which completed alone (group size 1)


def timed_run(command: list[str], work_dir: Path, from_step: int, steps: int) -> RunTiming:
    """Run ``command`` (it trains ``steps`` steps, logging to ``work_dir``/metrics.jsonl) in its own process group
    to its end, snapshotting its CPU times when the window's first and last step events appear (polled every
    POLL_S). Raises RuntimeError when it fails, outlives RUN_TIMEOUT_S or logs no such steps."""
    work_dir.mkdir(parents=True, exist_ok=True)
    metrics = work_dir / "metrics.jsonl"
    process = spawn(command, work_dir / "stdout.log", env=lab_environment())
    snapshots: dict[int, Snapshot] = {}
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            logged = {event.step for event in read_events(metrics, InnerStep)}
            for step in (from_step, steps):
                if step in logged and step not in snapshots:
                    snapshots[step] = Snapshot.take(process.pid)
            time.sleep(POLL_S)
    finally:
        stop_process_groups([process], grace_s=10.0)
    if process.returncode != 0 or len(snapshots) < 2:
        raise RuntimeError(f"{' '.join(command)} ended with {process.returncode}; see {work_dir / 'stdout.log'}")
    return timing(read_events(metrics, InnerStep), read_events(metrics, OuterRound), from_step, snapshots[from_step],
                  snapshots[steps])  # fmt: skip


def timing(
    marks: list[InnerStep], rounds: list[OuterRound], from_step: int, first: Snapshot, last: Snapshot
) -> RunTiming:
    """The window's numbers from a run's ``inner_step`` and ``outer_round`` events and its CPU snapshots; CPU per step
    is the CPU share between the snapshots times the wall time per step. Raises ValueError when the events do not
    cover the window."""
    steps = {event.step: event for event in marks}
    final = max(steps, default=0)
    if from_step not in steps or final <= from_step:
        raise ValueError(f"no inner_step events from step {from_step} on (last: {final})")
    start, end = steps[from_step].time, steps[final].time
    step_s = (end - start) / (final - from_step)
    window = [event for event in steps.values() if from_step < event.step]
    in_window = [event for event in rounds if start < event.time <= end]
    background = sum(cpu - first.background.get(pid, 0.0) for pid, cpu in last.background.items())
    per_step = step_s / (last.time - first.time)
    return RunTiming(
        step_s=step_s,
        train_step_s=statistics.mean(event.seconds for event in window),
        main_cpu_s=(last.main - first.main) * per_step,
        background_cpu_s=background * per_step,
        rounds=len(in_window),
        solo_rounds=sum(event.group_size == 1 for event in in_window),
    )


@dataclass
class Repeat:
    bare: RunTiming
    units: dict[str, RunTiming] = field(default_factory=dict)

    def overhead(self, variant: str) -> float:
        return self.units[variant].step_s / self.bare.step_s - 1.0


def measure(out: Path, steps: int, repeats: int, from_step: int, variants: dict[str, tuple[str, ...]]) -> list[Repeat]:
    """Run A and every variant of B ``repeats`` times, alternating (see the module docstring); runs' work dirs go
    to ``out``/runs. Raises RuntimeError when a run fails or a lone unit completed no round in the window, and
    ValueError unless 0 < ``from_step`` < ``steps``."""
    if not 0 < from_step < steps:
        raise ValueError(f"need 0 < from_step < steps, got from_step={from_step}, steps={steps}")
    setup = TrainingSetup(eval_every_steps=NEVER)
    results = []
    for index in range(repeats):
        order = ["bare", *variants]
        if index % 2:
            order.reverse()
        timings: dict[str, RunTiming] = {}
        for name in order:
            work_dir = out / "runs" / f"{index}-{name}"
            flags = shared_flags(steps, work_dir, setup)
            if name == "bare":
                command = module_command("bench.overhead", *flags)
            else:
                command = [*CLI, "join", *flags, *variants[name]]
            timings[name] = timed_run(command, work_dir, from_step, steps)
            if name != "bare" and timings[name].rounds == 0:
                raise RuntimeError(f"the lone unit completed no outer round in the window; see {work_dir}")
            print(f"repeat {index} {name}: {1e3 * timings[name].step_s:.1f} ms per step", flush=True)
        results.append(Repeat(timings.pop("bare"), timings))
    return results


def summary(results: list[Repeat], steps: int, from_step: int, command: list[str]) -> dict[str, Any]:
    """The JSON report: per variant the medians over repeats, every repeat, the machine."""
    median = statistics.median
    return {
        "command": " ".join(command),
        "steps": steps,
        "from_step": from_step,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "bare": {
            "median_step_s": median(repeat.bare.step_s for repeat in results),
            "median_train_step_s": median(repeat.bare.train_step_s for repeat in results),
            "median_main_cpu_s": median(repeat.bare.main_cpu_s for repeat in results),
        },
        "variants": {
            name: {
                "flags": " ".join(VARIANTS.get(name, ())),
                "median_overhead": median(repeat.overhead(name) for repeat in results),
                **{
                    f"median_{key}": median(getattr(repeat.units[name], key) for repeat in results)
                    for key in ("step_s", "train_step_s", "main_cpu_s", "background_cpu_s", "rounds")
                },
            }
            for name in results[0].units
        },
        "repeats": [asdict(repeat) for repeat in results],
    }


def markdown(report: dict[str, Any]) -> str:
    bare = report["bare"]
    lines = [
        f"Wall time per inner step from step {report['from_step']} to step {report['steps']}: the bare loop (A) "
        f"{1e3 * bare['median_step_s']:.1f} ms (train_step {1e3 * bare['median_train_step_s']:.1f} ms, CPU "
        f"{1e3 * bare['median_main_cpu_s']:.1f} ms), against a lone unit (B). Medians over repeats; the overhead is "
        "the median of B/A − 1. train_step: mean duration of the logged steps themselves; outside: the rest of the "
        "loop. CPU per step: the unit's main process, and its DHT, averagers, p2pd and watchdog.",
        "",
        "| variant | flags | B ms/step | overhead | train_step ms | outside ms | CPU main ms | CPU background ms "
        "| CPU, B/A | rounds in window |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["variants"].items():
        outside = row["median_step_s"] - row["median_train_step_s"]
        cpu_ratio = (row["median_main_cpu_s"] + row["median_background_cpu_s"]) / bare["median_main_cpu_s"]
        lines.append(
            f"| {name} | `{row['flags']}` | {1e3 * row['median_step_s']:.1f} | {row['median_overhead']:+.1%} | "
            f"{1e3 * row['median_train_step_s']:.1f} | {1e3 * outside:.1f} | {1e3 * row['median_main_cpu_s']:.1f} | "
            f"{1e3 * row['median_background_cpu_s']:.1f} | {cpu_ratio:.2f} | {row['median_rounds']:.0f} |"
        )
    heads = ["A ms/step", *(f"{name} ms/step (overhead)" for name in report["variants"])]
    lines += ["", "| repeat | " + " | ".join(heads) + " |", "|---" * (1 + len(heads)) + "|"]
    for index, repeat in enumerate(report["repeats"]):
        bare_step = repeat["bare"]["step_s"]
        units = [repeat["units"][name] for name in report["variants"]]
        cells = [f"{1e3 * bare_step:.1f}"] + [
            f"{1e3 * unit['step_s']:.1f} ({unit['step_s'] / bare_step - 1:+.1%})" for unit in units
        ]
        lines.append(f"| {index} | " + " | ".join(cells) + " |")
    lines += ["", f"Load average at the end: {report['machine']['load_average']}", "", "Reproduce with:", "", "```"]
    return "\n".join([*lines, report["command"], "```"])


def plot(report: dict[str, Any], path: Path) -> None:
    """Step time per repeat, A and every B variant."""
    import matplotlib  # here, not at the top: the bare loop's process imports this module

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    repeats = report["repeats"]
    figure, axes = plt.subplots(figsize=(7, 4))
    indices = range(len(repeats))
    axes.plot(indices, [1e3 * repeat["bare"]["step_s"] for repeat in repeats], marker="o", label="A: bare loop")
    for name in report["variants"]:
        values = [1e3 * repeat["units"][name]["step_s"] for repeat in repeats]
        axes.plot(indices, values, marker="s", label=f"B: lone unit {name}")
    axes.set_xlabel("repeat")
    axes.set_xticks(list(indices))
    axes.set_ylabel(f"ms per inner step (steps {report['from_step']}-{report['steps']})")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Run A (the bare loop) with ``p2p-diloco join`` flags."""
    parser = argparse.ArgumentParser(description="the bare inner loop of a learning unit (no DHT, no rounds)")
    add_config_arguments(parser)
    bare_loop(load_config(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
