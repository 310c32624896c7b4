"""LoRA adapters against full fine-tuning of the same pretrained model on the same data, side by side in one run:
per method, real learning units on 127.0.0.1 (bench/swarm.py) fine-tune the same base for the same inner steps with
the same seeds; the report gives the units' final held-out loss against the base's, the scalars each round averages,
and the bytes each unit's p2p daemon sent per merged round (``scripts/lora.py`` runs it).

The base is the embedded tiny GPT-2 pre-trained here, in-process, on the embedded corpus for ``base_steps`` steps
(deterministic: the tiny preset's seed and data order), then exported with ``save_pretrained``: the model every
method fine-tunes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.swarm import Swarm
from p2p_diloco.settings import load_config
from p2p_diloco.unit.data import load_text_data, shard_seed
from p2p_diloco.unit.events import Eval, Join, Stop
from p2p_diloco.unit.inner import InnerTrainer
from p2p_diloco.unit.model import export_pretrained, load_model

# method -> its own `join` flags (LoRA adapters usually take a larger learning rate than the full weights)
METHODS: dict[str, list[str]] = {
    "full fine-tuning": ["--inner-lr", "5e-4"],
    "LoRA r=8 (all linear layers)": ["--lora-r", "8", "--lora-alpha", "16", "--inner-lr", "2e-3"],
}
SHARED_FLAGS = ["--seq-len", "64", "--batch-size", "4", "--inner-steps", "10", "--warmup-steps", "10",
                "--eval-every-rounds", "5", "--threads", "1"]  # fmt: skip


@dataclass(frozen=True)
class MethodResult:
    method: str
    flags: list[str]
    trained_parameters: int  # scalars each round averages (twice that with the outer momentum)
    base_loss: float | None  # the first unit's eval of the base, at its join
    final_losses: list[float]  # every unit's final eval of its consensus model
    merged_rounds: list[int]
    bytes_per_merged_round: list[float]  # each unit's p2p daemon's bytes sent over its merged rounds
    seconds: float


def pretrained_base(out: Path, steps: int) -> Path:
    """The tiny preset's model trained ``steps`` steps on its data, exported to ``out``/base."""
    config = load_config(preset="tiny")
    loaded = load_model(config.model)
    data = load_text_data(config.data, loaded.tokenizer, shard_seed(config.model.seed, "lora base"))
    trainer = InnerTrainer(loaded.model, config.inner, loaded.device)
    batches = data.train_batches()
    for _ in range(steps):
        trainer.train_step(batches)
    return export_pretrained(loaded.model, loaded.tokenizer, out / "base")


def run_method(out: Path, method: str, base: Path, units: int, steps: int) -> MethodResult:
    """``units`` units fine-tune ``base`` with ``method``'s flags for ``steps`` inner steps each."""
    flags = [*SHARED_FLAGS, "--model", str(base), "--max-steps", str(steps), *METHODS[method]]
    names = [f"unit{index}" for index in range(units)]
    swarm = Swarm(out / _slug(method), run_id=f"lora-bench-{_slug(method)}", unit_flags=flags)
    try:
        maddr = swarm.bootstrap("bootstrap")
        for name in names:
            swarm.unit(name, [maddr])
        swarm.wait_for(lambda: not any(swarm.running(name) for name in names) or None, 1800, "every unit to finish")
    finally:
        swarm.close()
    evals = {name: [event.eval_loss for event in swarm.events(name, Eval) if event.eval_loss is not None]
             for name in names}  # fmt: skip
    stops = {name: swarm.events(name, Stop)[-1] for name in names}
    merged = {
        name: sum(1 for event in swarm.rounds(name) if event.status == "merged" and event.group_size > 1)
        for name in names
    }
    return MethodResult(
        method=method,
        flags=METHODS[method],
        trained_parameters=swarm.events(names[0], Join)[0].trained_parameters,
        base_loss=evals[names[0]][0] if evals[names[0]] else None,
        final_losses=[evals[name][-1] for name in names],
        merged_rounds=[merged[name] for name in names],
        bytes_per_merged_round=[(stops[name].wire_bytes_sent or 0) / max(1, merged[name]) for name in names],
        seconds=max(stop.time for stop in stops.values()) - min(swarm.events(n, Join)[0].time for n in names),
    )


def _slug(method: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in method.lower()).strip("-")


def write_report(out: Path, results: list[MethodResult], command: str, base_steps: int) -> None:
    """lora.json, lora.md and lora.png in ``out``."""
    document = {"command": command, "base_steps": base_steps, "methods": [asdict(result) for result in results]}
    (out / "lora.json").write_text(json.dumps(document, indent=1))
    full_loss = statistics.median(results[0].final_losses)
    full_sent = statistics.median(results[0].bytes_per_merged_round)
    rows = []
    for result in results:
        loss, sent = statistics.median(result.final_losses), statistics.median(result.bytes_per_merged_round)
        rows.append(
            f"| {result.method} | `{' '.join(result.flags)}` | {result.trained_parameters:,} | "
            f"{_fmt(result.base_loss)} | {loss:.4f} | {100 * (loss / full_loss - 1):+.2f}% | "
            f"{sent / 1e3:,.0f} | {sent / full_sent:.3f} | "
            f"{', '.join(map(str, result.merged_rounds))} | {result.seconds:.0f} |"
        )
    lines = ["# LoRA against full fine-tuning, real units", "", "Reproduce:", "", "    " + command, "",
             f"The base: the tiny GPT-2 pre-trained {base_steps} steps on the embedded corpus (bench/lora.py); every "
             f"method fine-tunes it with `{' '.join(SHARED_FLAGS)}`. Losses: the units' final held-out evals of their "
             "consensus models (median over units). Bytes: what each unit's p2p daemon sent (TCP), per merged round "
             "(median over units; DHT records included).", "",
             "| method | flags | averaged scalars | base loss | final loss | vs full | kB sent per merged round "
             "| vs full | merged rounds per unit | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]  # fmt: skip
    (out / "lora.md").write_text("\n".join(lines))
    _plot(results, out / "lora.png")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _plot(results: list[MethodResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, sent) = plt.subplots(1, 2, figsize=(10, 4))
    names = [result.method for result in results]
    finals = [statistics.median(result.final_losses) for result in results]
    losses.bar(names, finals)
    shown = finals + ([results[0].base_loss] if results[0].base_loss is not None else [])
    losses.set_ylim(min(shown) - 0.2, max(shown) + 0.1)
    if results[0].base_loss is not None:
        losses.axhline(results[0].base_loss, color="gray", linestyle="--", label="base")
        losses.legend()
    losses.set_ylabel("final held-out loss")
    sent.bar(names, [statistics.median(result.bytes_per_merged_round) / 1e3 for result in results])
    sent.set_ylabel("kB sent per merged round")
    sent.set_yscale("log")
    for axis in (losses, sent):
        axis.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
