"""The memory benchmark's report (bench/memory.py): the JSON, its markdown tables and its plot."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import psutil
import torch

MIB = 2**20


def summary(measured: dict[str, Any], command: list[str]) -> dict[str, Any]:
    """The JSON report: the command that reproduces it, the machine, and what :func:`bench.memory.measure` returned."""
    return {
        "command": " ".join(command),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total,
            "load_average": os.getloadavg(),
        },
        **measured,
    }


def _mib(value: float) -> str:
    return f"{value / MIB:.0f}"


def _run_row(model: str, trained: int, name: str, flags: str, run: dict[str, Any], excess: str, guess: str) -> str:
    steps = "" if run["inner_steps"] is None else str(run["inner_steps"])
    cells = [model, f"{trained / 1e6:.2f} M", name, f"`{flags}`" if flags else "", steps, _mib(run["peak_pss"]),
             f"{run['bytes_per_param']:.1f}", excess, guess, _mib(run["main_uss_peak"]), _mib(run["main_rss_hwm"]),
             str(run["max_processes"]), str(run["rounds"]), "yes" if run["checkpoint"] else "no",
             run["device"].get("note", str(run["device"]))]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def runs_table(report: dict[str, Any]) -> list[str]:
    """One row per run: peak tree PSS, per parameter, the unit's excess over the bare loop and the inventory's."""
    lines = [
        "| model | trained params | run | flags | inner steps | peak PSS MiB | B/param | excess over bare B/param "
        "| predicted excess B/param | main USS peak MiB | main VmHWM MiB | processes | rounds | checkpoint | device |",
        "|---" * 15 + "|",
    ]
    for model, result in report["models"].items():
        trained = result["trained_parameters"]
        lines.append(_run_row(model, trained, "bare loop", "", result["bare"], "", ""))
        for variant, unit in result["units"].items():
            guess = unit["predicted"]
            lines.append(_run_row(model, trained, variant, unit["flags"], unit["run"],
                                  f"{unit['run']['excess_bytes_per_param']:+.1f}",
                                  f"{guess['peak_low']:.0f}–{guess['peak_high']:.0f}"))  # fmt: skip
    short = [f"{model} {name}" for model, result in report["models"].items() for name, unit in result["units"].items()
             if (unit["run"]["inner_steps"] or 0) < result["steps"]]  # fmt: skip
    if short:
        lines += ["", f"Fewer inner steps than --max-steps {', '.join(short)}: stopped by SIGTERM, they left cleanly "
                  "(final rounds, settle, checkpoint)."]  # fmt: skip
    return lines


def process_table(report: dict[str, Any]) -> list[str]:
    """Per run, the tree's PSS at its peak by kind of process (MiB, and bytes per parameter)."""
    runs_of = [[result["bare"], *(unit["run"] for unit in result["units"].values())]
               for result in report["models"].values()]  # fmt: skip
    kinds = list(
        dict.fromkeys(process["kind"] for runs in runs_of for run in runs for process in run["peak_by_process"])
    )
    lines = ["| model | run | " + " | ".join(f"{kind} MiB (B/param)" for kind in kinds) + " |",
             "|---" * (2 + len(kinds)) + "|"]  # fmt: skip
    for model, result in report["models"].items():
        trained = result["trained_parameters"]
        runs = {"bare loop": result["bare"], **{name: unit["run"] for name, unit in result["units"].items()}}
        for name, run in runs.items():
            cells = []
            for kind in kinds:
                members = [process for process in run["peak_by_process"] if process["kind"] == kind]
                pss = sum(process["pss"] for process in members)
                count = f" ×{len(members)}" if len(members) > 1 else ""
                cells.append(f"{_mib(pss)}{count} ({pss / trained:.1f})" if members else "")
            lines.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
    return lines


def inventory_tables(report: dict[str, Any]) -> list[str]:
    """The inventory (bench/memory_inventory.py) with one column per variant; one table for models whose
    inventories are the same."""
    groups: dict[str, list[str]] = {}
    for model, result in report["models"].items():
        key = repr([unit["inventory"] for unit in result["units"].values()])
        groups.setdefault(key, []).append(model)
    lines: list[str] = []
    for names in groups.values():
        units = report["models"][names[0]]["units"]
        if not units:
            continue
        variants = list(units)
        first = units[variants[0]]["inventory"]
        lines += [f"Models: {', '.join(names)}.", "",
                  "| copy | process | lifetime | made at | " + " | ".join(variants) + " |",
                  "|---" * (4 + len(variants)) + "|"]  # fmt: skip
        for index, item in enumerate(first):
            values = [f"{units[v]['inventory'][index]['bytes_per_param']:g}" for v in variants]
            bare = " (bare loop too)" if item["bare"] else ""
            lines.append(f"| {item['what']}{bare} | {item['process']} | {item['lifetime']} | {item['source']} | "
                         + " | ".join(values) + " |")  # fmt: skip
        for key in ("persistent", "in_flight", "momentary", "peak_low", "peak_high"):
            values = [f"{units[v]['predicted'][key]:g}" for v in variants]
            lines.append(f"| **predicted excess: {key}** | | | | " + " | ".join(values) + " |")
        lines.append("")
    return lines


def markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    return "\n".join([
        "Reproduce with:", "", "```", report["command"], "```", "",
        f"Python {machine['python']}, torch {machine['torch']}, {machine['cpus']} CPUs, "
        f"{machine['memory_bytes'] / 2**30:.1f} GiB of memory; p2p_diloco from {report['package']}.", "",
        "Peak host memory: the peak over time of the sum of PSS over the run's whole process tree, sampled every "
        "0.2 s, over the trained parameters. Bare loop: the unit's model, batch and AdamW in one process "
        "(bench/overhead.py:bare_loop); unit: a lone `p2p-diloco join` of the same flags (its rounds complete alone "
        "after their window), a checkpoint every outer round. Excess: (unit peak − bare peak) / parameters. "
        "Predicted: the inventory below (persistent + in flight … + the largest momentary copy); it leaves out "
        "what does not grow with the model (interpreter, libraries, each child process's own heap).", "",
        *runs_table(report), "",
        "At the peak, PSS by process (forked: hivemind's DHT, averager and state-server processes):", "",
        *process_table(report), "",
        "Inventory of the model-sized copies a unit holds, in bytes per trained parameter "
        "(bench/memory_inventory.py):", "",
        *inventory_tables(report),
    ])  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> None:
    """The tree's PSS over time of every run, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["models"])
    figure, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for panel, name in zip(axes[0], names):
        result = report["models"][name]
        runs = {"bare loop": result["bare"], **{variant: unit["run"] for variant, unit in result["units"].items()}}
        for label, run in runs.items():
            timeline = run["timeline"]
            panel.plot([t for t, _, _ in timeline], [pss / MIB for _, pss, _ in timeline], label=label)
        panel.set_title(f"{name} ({result['trained_parameters'] / 1e6:.1f} M parameters)")
        panel.set_xlabel("seconds since start")
        panel.set_ylabel("PSS of the process tree (MiB)")
        panel.grid(alpha=0.3)
        panel.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
