"""The device check: two learning units share one accelerator and train the SmolLM2-135M architecture in bf16
autocast for a fixed number of steps; the report gives each unit's tokens/s, its peak device memory per parameter and
its merged outer rounds (``scripts/device_check.py`` runs it; docs/units.md says how to carry it to a lent GPU).

The architecture is built from ``bench/models/smollm2-135m/config.json`` with weights drawn from the seed, and the
embedded tokenizer (its ids are a subset of SmolLM2's vocabulary): the pretrained weights (540 MB) cannot travel to a
lent machine, and throughput and memory do not depend on their values. Two ranks of one unit need two devices (NCCL
refuses two ranks on one GPU), so the one-GPU check runs two units.

A check fails (exit 1) when a unit exits non-zero or merges no round with the other; the JSON and markdown are
written either way.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.swarm import Swarm
from p2p_diloco.presets import TINY_MODEL
from p2p_diloco.unit.events import Join, Stop

SMOLLM2_CONFIG = Path(__file__).parent / "models" / "smollm2-135m"
UNITS = ("a", "b")


@dataclass(frozen=True)
class UnitResult:
    name: str
    exit_code: int | None
    trained_parameters: int
    inner_steps: int
    tokens_per_s: float | None  # the unit's tokens over its inner-step compute seconds
    peak_device_bytes_per_parameter: float | None  # None on the CPU
    merged_rounds: int  # fragment rounds merged with the other unit


def unit_flags(steps: int, device: str, model_config: Path, seq_len: int, batch_size: int) -> list[str]:
    """The ``join`` flags of each unit of the check."""
    return [
        "--model-config", str(model_config), "--tokenizer", str(TINY_MODEL), "--device", device,
        "--autocast", "bfloat16" if device != "cpu" else "none", "--seq-len", str(seq_len),
        "--batch-size", str(batch_size), "--inner-lr", "3e-4", "--inner-steps", "20", "--max-steps", str(steps),
        "--eval-every-rounds", "5", "--eval-batches", "2", "--threads", "4", "--schedule", "clock",
    ]  # fmt: skip


def run_check(
    out: Path, steps: int, device: str, model_config: Path, seq_len: int, batch_size: int
) -> list[UnitResult]:
    """Two units of ``model_config`` on ``device`` through a bootstrap on 127.0.0.1, ``steps`` inner steps each;
    every process is stopped on return."""
    swarm = Swarm(out / "swarm", run_id="device-check")
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in UNITS:
            swarm.unit(name, [maddr], *unit_flags(steps, device, model_config, seq_len, batch_size))
        swarm.wait_for(lambda: all(not swarm.running(name) for name in UNITS) or None, timeout_s=600,
                       what="both units to finish")  # fmt: skip
        return [_result(swarm, name) for name in UNITS]
    finally:
        swarm.close()


def _result(swarm: Swarm, name: str) -> UnitResult:
    joins, stops = swarm.events(name, Join), swarm.events(name, Stop)
    trained = joins[0].trained_parameters if joins else 0
    stop = stops[-1] if stops else None
    peak = stop.peak_device_bytes if stop is not None else None
    return UnitResult(
        name=name,
        exit_code=swarm.processes[name].returncode,
        trained_parameters=trained,
        inner_steps=stop.inner_step if stop else 0,
        tokens_per_s=stop.tokens / stop.compute_s if stop and stop.compute_s > 0 else None,
        peak_device_bytes_per_parameter=peak / trained if peak is not None and trained else None,
        merged_rounds=sum(1 for event in swarm.rounds(name) if event.status == "merged" and event.group_size == 2),
    )


def passed(results: list[UnitResult]) -> bool:
    return all(result.exit_code == 0 and result.merged_rounds > 0 for result in results)


def write_report(out: Path, results: list[UnitResult], command: list[str], device: str) -> None:
    """``device_check.json`` and ``device_check.md`` in ``out``."""
    environment = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else "cpu",
    }
    report = {"command": command, "environment": environment, "passed": passed(results),
              "units": [asdict(result) for result in results]}  # fmt: skip
    (out / "device_check.json").write_text(json.dumps(report, indent=2))
    rows = [
        f"| {r.name} | {r.exit_code} | {r.trained_parameters:,} | {r.inner_steps} | "
        f"{_number(r.tokens_per_s, '.0f')} | {_number(r.peak_device_bytes_per_parameter, '.2f')} | {r.merged_rounds} |"
        for r in results
    ]
    lines = [
        "# Device check: two units on one device", "", "Reproduce:", "", "    " + " ".join(command), "",
        f"Environment: {environment}", "", f"Passed: {report['passed']}", "",
        "| unit | exit | parameters | inner steps | tokens/s | peak device bytes per parameter | merged rounds |",
        "|---|---|---|---|---|---|---|", *rows, "",
    ]  # fmt: skip
    (out / "device_check.md").write_text("\n".join(lines))


def _number(value: float | None, spec: str) -> str:
    return "not measured" if value is None else format(value, spec)
