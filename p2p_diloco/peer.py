"""Start one learning unit: wire the model, data, DHT, records, round plan, averagers and state server together, train,
and release everything on exit."""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import hivemind
import torch

from p2p_diloco.config import Codec, PeerConfig, SwarmSections
from p2p_diloco.network.averaging import OuterAverager
from p2p_diloco.network.compression import hivemind_compression
from p2p_diloco.network.dht import check_addresses, peer_identity, start_dht, stop_dht, visible_multiaddrs
from p2p_diloco.network.membership import MemberGate, MembershipError, load_run_access
from p2p_diloco.network.reachability import reachability_of, serve_dial_back_checks
from p2p_diloco.network.records import SwarmRecords, members_key, record_validators, run_record_keys
from p2p_diloco.network.state_sync import StateServer
from p2p_diloco.rounds.plan import KeySchema, RoundPlan
from p2p_diloco.unit import events
from p2p_diloco.unit.data import TextData, check_sources, load_text_data, shard_seed
from p2p_diloco.unit.forking import dropped_in_forked_children, module_tensors
from p2p_diloco.unit.inner import EvalBatch, InnerTrainer
from p2p_diloco.unit.joining import JoinError
from p2p_diloco.unit.metrics import MetricsLog
from p2p_diloco.unit.model import LoadedModel, load_model, round_plan
from p2p_diloco.unit.ranks import Ranks, join_ranks, rank_identity, theta_probe
from p2p_diloco.unit.tracking import RoundLines, UnitReport, open_trackers, run_description, write_run_file
from p2p_diloco.unit.unit import LearningUnit, UnitNetwork

SETTLE_GROUP_SIZE = 256  # the largest target group the configuration allows

logger = logging.getLogger(__name__)


def run_peer(config: PeerConfig, stop: threading.Event) -> None:
    """Run a learning unit until ``stop`` is set or a run limit is reached, then leave cleanly.

    Raises ModelLoadError, DatasetLoadError, NetworkError, JoinError, CheckpointError or ConfigError (one-line messages)
    for input the unit cannot work with; every process it started is stopped before it returns or raises.
    """
    check_addresses(config.network)  # what can be refused before the model is built and the DHT starts
    check_sources(config.data)
    if config.run.threads is not None:
        torch.set_num_threads(config.run.threads)
    ranks = join_ranks(config.model.device, sharded=config.run.shard_model)
    try:
        loaded = load_model(config.model, ranks.local_rank, on_host=ranks.sharded)  # sharded before it moves
        ranks.prepare(loaded.model, loaded.device)
        if ranks.lead:
            _run_lead(config, loaded, ranks, stop)
        else:
            _run_follower(config, loaded, ranks)
    finally:
        ranks.close()


def _run_lead(config: PeerConfig, loaded: LoadedModel, ranks: Ranks, stop: threading.Event) -> None:
    """The unit's peer in the swarm (its only process, or rank 0 of several), training on its data shard."""

    def data(peer_id: str) -> TextData:  # rank 0's shard
        return load_text_data(config.data, loaded.tokenizer, shard_seed(config.model.seed, peer_id))

    with unit_in_swarm(config, loaded, data, ranks) as unit:
        unit.run(stop)


@contextlib.contextmanager
def unit_in_swarm(
    config: SwarmSections,
    loaded: LoadedModel,
    data: Callable[[str], TextData | None],
    ranks: Ranks | None = None,
    trainer: InnerTrainer | None = None,
    eval_batches: Sequence[EvalBatch] = (),
) -> Iterator[LearningUnit]:
    """A learning unit of ``loaded`` in the swarm of ``config.network``, joined (its state downloaded, resumed or
    initial), its data ``data(its peer id)`` (None: its caller trains it); on exit its exit rounds, final eval,
    checkpoint and export, unless its ranks broke (the launcher then restarts it). ``trainer``, ``eval_batches``: see
    LearningUnit. Every process it started is stopped on exit, whatever the exit.

    Raises NetworkError, JoinError, MembershipError or CheckpointError (one-line messages)."""
    ranks = ranks or Ranks()
    trained = [param for param in loaded.model.parameters() if param.requires_grad]
    plan = round_plan(config.outer, loaded.model, trained)
    theta = ranks.theta(trained)  # whole tensors, shaped like what the unit averages and serves
    run_id = config.network.run_id
    identity = peer_identity(config.network.identity_path)
    if config.network.admission is not None and identity.fresh:
        raise MembershipError("--admission needs the --identity-path whose peer id it admits")
    access = load_run_access(run_id, config.network.admission, identity.peer_id)
    validators = record_validators(access, identity.key)
    gate = MemberGate(access, members_key(run_id))
    interrupt = signal.getsignal(signal.SIGINT)
    with contextlib.ExitStack() as owned:
        owned.enter_context(dropped_in_forked_children(functools.partial(module_tensors, loaded.model)))
        reachability = reachability_of(config.network)
        dht = start_dht(config.network, identity=identity, record_validators=validators, reachability=reachability)
        owned.callback(stop_dht, dht)
        if not reachability.client_mode:
            dht.run_coroutine(serve_dial_back_checks)
        multiaddrs = " ".join(visible_multiaddrs(dht))
        logger.info("other peers can join through: %s", multiaddrs)
        records = SwarmRecords(dht, access, validators)
        records.publish_membership(wait=True)
        claim = records.claim_model_fingerprint(loaded.fingerprint)
        if claim.fingerprint != loaded.fingerprint:
            raise JoinError(
                f"model fingerprint {loaded.fingerprint} differs from run '{run_id}' fingerprint {claim.fingerprint}: "
                "this model cannot average with the swarm's"
            )
        peer_id = str(dht.peer_id)
        keys = plan.keys(run_id, loaded.fingerprint)
        new_averagers = functools.partial(_averagers, owned, dht, plan, gate)
        averagers = new_averagers(keys.fragment_round, plan.round_templates(theta), plan.step.codec)
        consensus = plan.consensus_templates() if plan.consensus else []
        consensus_averagers = new_averagers(keys.consensus_round, consensus, "fp32")
        state_server = StateServer(dht, keys.state(), theta, records, fragments=len(plan.fragments), gate=gate,
                                   momentum=plan.keeps_momentum)  # fmt: skip
        owned.callback(state_server.shutdown)
        settle_gate = gate.shunning_suspects()
        settle = functools.partial(_settle_averager, dht, plan, settle_gate, keys.settle())
        network = UnitNetwork(averagers, consensus_averagers, state_server, records, peer_id, settle,
                              settle_refuses=settle_gate.refused)  # fmt: skip
        signal.signal(signal.SIGINT, interrupt)  # starting a hivemind averager turned Ctrl+C off in this process
        metrics = owned.enter_context(_unit_report(config, plan, peer_id))
        unit = LearningUnit(config, plan, loaded, data(peer_id), network, metrics, ranks, trainer, eval_batches)
        owned.enter_context(dropped_in_forked_children(unit.host_tensors))  # the settle averager's fork at exit
        source = unit.join(swarm_seen=claim.earlier)
        _describe_run(config, metrics, peer_id, keys)
        metrics.write(events.Join(peer_id=peer_id, source=source, outer_round=unit.outer_round, ranks=ranks.world_size,
                                  trained_parameters=sum(param.numel() for param in theta),
                                  fingerprint=loaded.fingerprint, multiaddrs=multiaddrs))  # fmt: skip
        logger.info("joined run=%s peer_id=%s source=%s outer_round=%d ranks=%d", run_id, peer_id, source,
                    unit.outer_round, ranks.world_size)  # fmt: skip
        try:
            yield unit
        finally:
            if not ranks.broken:  # else the launcher restarts the unit: no exit rounds with a broken unit
                unit.finish()


def _unit_report(config: SwarmSections, plan: RoundPlan, peer_id: str) -> UnitReport:
    """Where the unit's events go (tracking.py)."""
    work_dir = Path(config.run.work_dir)
    trackers = open_trackers(config.run.report_to, work_dir, config.network.run_id, peer_id)
    return UnitReport(MetricsLog(work_dir / "metrics.jsonl"), RoundLines(len(plan.fragments)), trackers)


def _describe_run(config: SwarmSections, report: UnitReport, peer_id: str, keys: KeySchema) -> None:
    """The run described once the unit joined: in its work dir (``run.json``) and to its trackers."""
    description = run_description(config.model_dump(mode="json"), peer_id,
                                  {**keys.prefixes(), **run_record_keys(config.network.run_id)})  # fmt: skip
    write_run_file(Path(config.run.work_dir), description)
    report.describe(description)


def _run_follower(config: PeerConfig, loaded: LoadedModel, ranks: Ranks) -> None:
    """A rank other than 0: train its replica or shard on its own shard of the data, following rank 0 (ranks.py),
    until rank 0 stops. A stop signal is rank 0's to act on (the launcher forwards it to every rank): this rank goes
    on until rank 0 tells it to stop, or until the launcher kills it."""
    trainer = InnerTrainer(loaded.model, config.inner, loaded.device, loaded.autocast, ranks.replica,
                           sharded=ranks.sharded)  # fmt: skip
    start = ranks.share_start(trainer)
    seed = shard_seed(config.model.seed, rank_identity(start.peer_id, ranks.rank))
    data = load_text_data(config.data, loaded.tokenizer, seed)
    with MetricsLog(Path(config.run.work_dir) / f"rank{ranks.rank}.jsonl") as log:

        def probe(inner_step: int) -> None:  # a replica's θ, to compare with rank 0's
            if ranks.replicated:
                log.write(events.ReplicaProbe(rank=ranks.rank, inner_step=inner_step,
                                              values=theta_probe(trainer.params)))  # fmt: skip

        probe(start.inner_step)
        ranks.follow(trainer, data.train_batches(), data.eval_batches, start.inner_step, probe)


def _settle_averager(
    dht: hivemind.DHT, plan: RoundPlan, gate: MemberGate, prefix: str, template: Sequence[torch.Tensor]
) -> OuterAverager:
    """The averager of a unit's settle rounds at exit: fp32, groups as large as hivemind takes, so that
    every unit leaving at the same boundary meets; the unit shuts it down."""
    return OuterAverager(dht, prefix, template, quorum=1, target_group_size=SETTLE_GROUP_SIZE,
                         allreduce_timeout_s=plan.group.allreduce_timeout_s, gate=gate)  # fmt: skip


def _averagers(
    owned: contextlib.ExitStack,
    dht: hivemind.DHT,
    plan: RoundPlan,
    gate: MemberGate,
    prefix: Callable[[int], str],
    templates: list[list[torch.Tensor]],
    codec: Codec,
) -> list[OuterAverager]:
    """One averager per template (fragment), under ``prefix(fragment)``, each shut down with ``owned``."""
    averagers = []
    for number, template in enumerate(templates):
        averager = OuterAverager(
            dht,
            prefix(number),
            template,
            quorum=plan.group.quorum,
            target_group_size=plan.group.target_size,
            allreduce_timeout_s=plan.group.allreduce_timeout_s,
            compression=hivemind_compression(codec),
            gate=gate,
            directed=True,
        )
        owned.callback(averager.shutdown)
        averagers.append(averager)
    return averagers
