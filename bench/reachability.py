"""What a unit that cannot accept connections costs a round: two units in network namespaces behind rate-limited links
(namespaces.py, on addresses libp2p takes for public ones), with a bootstrap node that is also their relay. Arms:

- ``direct``: both units reachable (each reduces half of every round);
- ``client``: unit1's namespace drops every inbound connection and unit1 joins with ``--no-use-relays``, in client
  mode: unit0 leads and reduces every round;
- ``relayed``: the same firewalled unit1 with relays on (the default): reached through the bootstrap node's relay;
- ``relayed pair``: both units firewalled and relayed: no unit can dial the other, only the relay connects them.

Arms alternate, each in a fresh swarm, ``repeats`` times; per unit it records each paired round's seconds and the
bytes its p2p daemon sent and received between consecutive paired rounds, and per swarm the bytes that crossed the
bootstrap node's link while the measured rounds ran (what it relayed, plus its DHT traffic). Root only.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.chaos.namespaces import PUBLIC_SUBNET, Namespaces
from bench.swarm import QUICK_UNIT_FLAGS, Swarm
from p2p_diloco.unit.events import Join, OuterRound

ARMS = ("direct", "client", "relayed", "relayed pair")
UNITS = ("unit0", "unit1")
FIREWALLED = {"direct": (), "client": ("unit1",), "relayed": ("unit1",), "relayed pair": UNITS}
UNIT_FLAGS = (*QUICK_UNIT_FLAGS, "--quorum", "2", "--target-group-size", "2", "--settle-rounds", "0")


@dataclass(frozen=True)
class UnitRounds:
    arm: str
    repeat: int
    unit: str
    reachability: str  # direct, relayed or client: how other peers reached the unit (its DHT start log line)
    seconds: list[float]  # each paired round's, from the unit's outer_round events
    sent_mb: list[float]  # per round, from its p2p daemon's counters between consecutive paired rounds
    received_mb: list[float]
    bootstrap_mb_per_round: float  # sent + received on the bootstrap node's link while the rounds ran, per round


def run_arm(arm: str, repeat: int, root: Path, rounds: int, rate_mbit: float, timeout_s: float) -> list[UnitRounds]:
    """One swarm of ``arm``: a bootstrap node and UNITS until each merged ``rounds`` + 1 rounds in pairs (the first
    is dropped: it waited for the second unit to join)."""
    namespaces = Namespaces(["bootstrap", *UNITS], prefix="pdcb-", rate_mbit=rate_mbit, subnet=PUBLIC_SUBNET)
    swarm = Swarm(root, run_id=f"reach-{arm.replace(' ', '-')}-{repeat}", network=namespaces, unit_flags=UNIT_FLAGS)
    try:
        for name in FIREWALLED[arm]:
            namespaces.drop_inbound(name)
        bootstrap = swarm.bootstrap("bootstrap")
        swarm.unit("unit0", [bootstrap])
        swarm.wait_for(lambda: swarm.events("unit0", Join), timeout_s, "unit0 joined")
        swarm.unit("unit1", [bootstrap], *(["--no-use-relays"] if arm == "client" else []))

        def paired(name: str) -> list[OuterRound]:
            return [merged for merged in swarm.rounds(name) if merged.group_size == 2]

        swarm.wait_for(lambda: min(len(paired(n)) for n in UNITS) >= 1, timeout_s, "a paired round")
        relayed_before = sum(namespaces.interface_bytes("bootstrap"))
        swarm.wait_for(lambda: min(len(paired(n)) for n in UNITS) > rounds, timeout_s, f"{rounds + 1} paired rounds")
        bootstrap_mb = (sum(namespaces.interface_bytes("bootstrap")) - relayed_before) / 1e6 / rounds
        return [_unit_rounds(arm, repeat, name, paired(name)[: rounds + 1], root, bootstrap_mb) for name in UNITS]
    finally:
        swarm.close(grace_s=0.0)
        namespaces.close()


def _unit_rounds(
    arm: str, repeat: int, name: str, merged: list[OuterRound], root: Path, bootstrap_mb: float
) -> UnitRounds:
    sent = [r.wire_bytes_sent for r in merged]
    received = [r.wire_bytes_received for r in merged]
    if any(value is None for value in [*sent, *received]):
        raise RuntimeError(f"{name}: rounds without wire counters")
    log = (root / name / "stdout.log").read_text()
    modes = [mode for mode in ("direct", "relayed", "client") if f"reachability={mode}" in log]
    return UnitRounds(
        arm=arm,
        repeat=repeat,
        unit=name,
        reachability="/".join(modes) or "unknown",
        seconds=[r.seconds for r in merged[1:]],
        sent_mb=[(b - a) / 1e6 for a, b in zip(sent, sent[1:])],  # type: ignore[operator]
        received_mb=[(b - a) / 1e6 for a, b in zip(received, received[1:])],  # type: ignore[operator]
        bootstrap_mb_per_round=bootstrap_mb,
    )


def summary(results: list[UnitRounds]) -> list[dict[str, object]]:
    """Per arm and unit: median round seconds, MB per round and the bootstrap node's MB per round over every repeat,
    and the ratio of the round seconds to the direct arm's same unit."""
    rows = []
    for arm in ARMS:
        for unit in UNITS:
            picked = [r for r in results if r.arm == arm and r.unit == unit]
            if not picked:
                continue
            rows.append({
                "arm": arm, "unit": unit, "reachability": "/".join(sorted({r.reachability for r in picked})),
                "rounds": sum(len(r.seconds) for r in picked),
                "median_round_s": statistics.median(s for r in picked for s in r.seconds),
                "median_sent_mb": statistics.median(s for r in picked for s in r.sent_mb),
                "median_received_mb": statistics.median(s for r in picked for s in r.received_mb),
                "median_bootstrap_mb": statistics.median(r.bootstrap_mb_per_round for r in picked),
            })  # fmt: skip
    direct = {row["unit"]: row["median_round_s"] for row in rows if row["arm"] == "direct"}
    for row in rows:
        base = direct.get(row["unit"])
        row["round_s_vs_direct"] = float(row["median_round_s"]) / float(base) if base else None  # type: ignore[arg-type]
    return rows


def write_results(out: Path, results: list[UnitRounds], setup: dict[str, object]) -> None:
    """results.json (every round), results.md (the summary table) and rounds.png (round seconds per arm and unit)."""
    rows = summary(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"setup": setup, "summary": rows,
                                                  "runs": [asdict(r) for r in results]}, indent=1))  # fmt: skip
    header = (
        "| arm | unit | reached | rounds | median round s | vs direct | MB sent/round | MB received/round "
        "| bootstrap MB/round |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = row["round_s_vs_direct"]
        lines.append(
            f"| {row['arm']} | {row['unit']} | {row['reachability']} | {row['rounds']} | "
            f"{row['median_round_s']:.2f} | {'' if ratio is None else f'{ratio:.2f}x'} | "
            f"{row['median_sent_mb']:.2f} | {row['median_received_mb']:.2f} | {row['median_bootstrap_mb']:.2f} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(out / "rounds.png", results)


def _plot(path: Path, results: list[UnitRounds]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.5))
    labels, data = [], []
    for arm in ARMS:
        for unit in UNITS:
            labels.append(f"{arm}\n{unit}")
            data.append([s for r in results if r.arm == arm and r.unit == unit for s in r.seconds])
    axis.boxplot(data, tick_labels=labels)
    axis.set_ylabel("paired round, seconds")
    axis.set_title("firewalled units (client mode, relayed) against reachable ones")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
