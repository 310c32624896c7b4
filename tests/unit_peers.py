"""Learning units wired to in-memory network fakes (tests/fakes.py), with the real tiny model, corpus, inner trainer,
checkpoints and metrics log: the ``make_peer`` fixture (registered in conftest.py) and the steps of LearningUnit.run,
one by one."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import FakeAverager, FakeGroup, FakeRecords, FakeStateServer

from p2p_diloco.config import PeerConfig
from p2p_diloco.network.state_sync import SwarmState
from p2p_diloco.presets import CORPUS, TINY_MODEL
from p2p_diloco.rounds.engine import RoundEngine
from p2p_diloco.rounds.results import RoundId, RoundKind
from p2p_diloco.settings import load_config
from p2p_diloco.streaming import SentRound
from p2p_diloco.unit.data import load_text_data, shard_seed
from p2p_diloco.unit.events import E, read_events
from p2p_diloco.unit.metrics import MetricsLog
from p2p_diloco.unit.model import load_model, round_plan
from p2p_diloco.unit.unit import LearningUnit, UnitNetwork

SEQ_LEN, BATCH_SIZE = 32, 2
TOKENS_PER_STEP = SEQ_LEN * BATCH_SIZE
SYNC_DATA_PARALLEL = dict(
    outer__inner_steps=1, outer__outer_lr=1.0, outer__outer_momentum=0.0, outer__sync_momentum=True
)


@dataclass
class Peer:
    """A learning unit with its fakes and its training batch stream."""

    unit: LearningUnit
    averager: FakeAverager
    state_server: FakeStateServer
    records: FakeRecords
    batches: Iterator[torch.Tensor]
    work_dir: Path
    averagers: list[FakeAverager]  # one per fragment; ``averager`` is the first
    consensus: list[FakeAverager]  # one per fragment, when the plan has consensus rounds

    def events(self, kind: type[E]) -> list[E]:
        return read_events(self.work_dir / "metrics.jsonl", kind)


PeerFactory = Callable[..., Peer]


def make_config(work_dir: Path, **overrides: Any) -> PeerConfig:
    settings: dict[str, Any] = dict(
        model__model_config_path=str(TINY_MODEL),
        model__device="cpu",
        data__dataset=str(CORPUS),
        data__seq_len=SEQ_LEN,
        data__batch_size=BATCH_SIZE,
        data__eval_batches=1,
        inner__warmup_steps=0,
        outer__inner_steps=2,
        outer__schedule="steps",  # these units count steps; the clock schedule's tests set it
        outer__outer_momentum=0.9,  # the outer momentum and its sync in play (SYNC_DATA_PARALLEL: a plain average)
        run__work_dir=str(work_dir),
        run__progress=False,
    )
    return load_config(**{**settings, **overrides})


@pytest.fixture
def make_peer(tmp_path: Path) -> Iterator[PeerFactory]:
    """Builds learning units named after their work directory (and peer id) under tmp_path."""
    logs: list[MetricsLog] = []

    def factory(
        name: str,
        group: FakeGroup | Sequence[FakeGroup],
        records: FakeRecords | None = None,
        served: SwarmState | None = None,
        consensus_groups: Sequence[FakeGroup] = (),
        settle_group: FakeGroup | None = None,
        **overrides: Any,
    ) -> Peer:
        """``group``: one per streaming fragment (a single group for P = 1); ``consensus_groups`` one per fragment
        when the plan has consensus rounds; ``settle_group``: where its settle averager (made at exit) meets."""
        work_dir = tmp_path / name
        config = make_config(work_dir, **overrides)
        loaded = load_model(config.model)  # same seed ⇒ same initial weights on every unit
        data = load_text_data(config.data, loaded.tokenizer, shard_seed(config.model.seed, name))
        trained = [param for param in loaded.model.parameters() if param.requires_grad]
        plan = round_plan(config.outer, loaded.model, trained)
        groups = [group] if isinstance(group, FakeGroup) else list(group)
        averagers = [g.averager(t, name) for g, t in zip(groups, plan.round_templates(trained), strict=True)]
        templates = plan.consensus_templates() if consensus_groups else []
        consensus = [g.averager(t, name) for g, t in zip(consensus_groups, templates, strict=True)]
        state_server, records = FakeStateServer(served), records if records is not None else FakeRecords()
        metrics = MetricsLog(work_dir / "metrics.jsonl")
        logs.append(metrics)
        settle = None if settle_group is None else lambda template: settle_group.averager(template, name)
        network = UnitNetwork(averagers, consensus, state_server, records, name, settle)
        unit = LearningUnit(config, plan, loaded, data, network, metrics)
        return Peer(unit, averagers[0], state_server, records, data.train_batches(), work_dir, averagers, consensus)

    yield factory
    for log in logs:
        log.close()


# ------------------------------------------------------------------- the steps of LearningUnit.run, one by one
def inner_step(peer: Peer) -> float:
    """One inner step; returns its compute seconds."""
    return peer.unit.train_step(peer.batches).seconds


def poll(peer: Peer) -> bool:
    """Whether a round ended."""
    return bool(peer.unit.poll_round())


def maybe_begin(peer: Peer) -> bool:
    return peer.unit.maybe_begin_round()


def train_until_round(peer: Peer) -> float:
    """Inner steps until the unit begins its next round (it must have none in flight); returns their compute
    seconds."""
    assert sent_round(peer.unit.engine, 0) is None
    seconds = sum(inner_step(peer) for _ in range(peer.unit.config.outer.inner_steps))
    assert maybe_begin(peer)
    return seconds


def set_rounds(peer: Peer, rounds: list[int]) -> None:
    """Put the unit's fragments at these outer rounds (φ and m unchanged)."""
    state = peer.unit.state
    state.load_state(state.global_params, state.momentum, rounds)


def sent_round(engine: RoundEngine, number: int = 0) -> SentRound | None:
    """What fragment ``number``'s round in flight sent (None: none in flight)."""
    flight = engine.in_flight.get(RoundId(RoundKind.FRAGMENT, number))
    if flight is None:
        return None
    assert isinstance(flight.sent, SentRound)
    return flight.sent
