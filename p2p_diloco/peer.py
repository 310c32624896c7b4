"""Start one learning unit: load model and data, join the DHT, train, and release everything on exit."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import hivemind
import torch

from p2p_diloco import events
from p2p_diloco.averaging import OuterAverager
from p2p_diloco.compression import hivemind_compression
from p2p_diloco.config import ConfigError, PeerConfig
from p2p_diloco.data import load_text_data, shard_seed
from p2p_diloco.dht import start_dht, stop_dht, visible_multiaddrs
from p2p_diloco.fragments import partition, views
from p2p_diloco.lifecycle import install_stop_signals
from p2p_diloco.metrics import MetricsLog
from p2p_diloco.model import load_model
from p2p_diloco.records import SwarmRecords, record_validators
from p2p_diloco.state_sync import StateServer
from p2p_diloco.unit import JoinError, LearningUnit

logger = logging.getLogger(__name__)


def run_peer(config: PeerConfig, stop: threading.Event) -> None:
    """Run a learning unit until ``stop`` is set or a run limit is reached, then leave cleanly.

    Raises ModelLoadError, DatasetLoadError, NetworkError, JoinError, CheckpointError or ConfigError (one-line messages)
    for input the unit cannot work with; every process it started is stopped before it returns or raises.
    """
    if config.run.threads is not None:
        torch.set_num_threads(config.run.threads)
    loaded = load_model(config.model)
    run_id = config.network.run_id
    validators = record_validators(run_id)
    with contextlib.ExitStack() as owned:
        dht = start_dht(config.network, record_validators=validators)
        owned.callback(stop_dht, dht)
        peer_id = str(dht.peer_id)
        multiaddrs = " ".join(visible_multiaddrs(dht))
        logger.info("other peers can join through: %s", multiaddrs)
        records = SwarmRecords(dht, run_id, validators)
        swarm_fingerprint = records.claim_model_fingerprint(loaded.fingerprint)
        if swarm_fingerprint != loaded.fingerprint:
            raise JoinError(
                f"model fingerprint {loaded.fingerprint} differs from run '{run_id}' fingerprint {swarm_fingerprint}: "
                "this model cannot average with the swarm's"
            )
        data = load_text_data(config.data, loaded.tokenizer, shard_seed(config.model.seed, peer_id))
        trained = [param for param in loaded.model.parameters() if param.requires_grad]
        prefix = f"{run_id}_{loaded.fingerprint}"
        outer = config.outer
        try:
            fragments = partition([param.shape for param in trained], outer.fragments)
        except ValueError as error:
            raise ConfigError(f"invalid config outer.fragments (--fragments): {error}") from None
        stream = f"{prefix}_p{outer.fragments}_{outer.codec}"  # units of other streaming settings never meet
        averagers = []
        for fragment in fragments:
            template = views(trained, fragment)
            averagers.append(_averager(config, dht, f"{stream}_f{fragment.number}", template * _copies(config)))
            owned.callback(averagers[-1].shutdown)
        consensus_averagers = None
        if outer.codec != "fp32" and outer.consensus_every_rounds > 0:
            consensus_averagers = []
            for fragment in fragments:
                template = [torch.zeros(fragment.numel)]
                prefix = f"{stream}_consensus_f{fragment.number}"
                consensus_averagers.append(_averager(config, dht, prefix, template, lossless=True))
                owned.callback(consensus_averagers[-1].shutdown)
        state_server = StateServer(dht, f"{prefix}_p{outer.fragments}_state", trained, fragments=len(fragments))
        owned.callback(state_server.shutdown)
        install_stop_signals()  # starting a hivemind averager turned Ctrl+C off in this process
        metrics = owned.enter_context(MetricsLog(Path(config.run.work_dir) / "metrics.jsonl"))
        unit = LearningUnit(
            config, loaded, data, averagers, state_server, records, peer_id, metrics, consensus_averagers
        )
        source = unit.join()
        metrics.write(
            events.Join(
                peer_id=peer_id,
                source=source,
                outer_round=unit.outer_round,
                fingerprint=loaded.fingerprint,
                multiaddrs=multiaddrs,
            )
        )
        logger.info("joined run=%s peer_id=%s source=%s outer_round=%d", run_id, peer_id, source, unit.outer_round)
        try:
            unit.run(stop)
        finally:
            unit.finish()


def _copies(config: PeerConfig) -> int:
    """How many copies of a fragment's shapes a round averages: φ and m for fp32 proposals with momentum, else one."""
    return 2 if config.outer.codec == "fp32" and config.outer.sync_momentum else 1


def _averager(
    config: PeerConfig, dht: hivemind.DHT, prefix: str, template: list[torch.Tensor], lossless: bool = False
) -> OuterAverager:
    outer = config.outer
    return OuterAverager(
        dht,
        prefix,
        template,
        quorum=outer.quorum,
        target_group_size=outer.target_group_size,
        allreduce_timeout_s=outer.allreduce_timeout_s,
        compression=hivemind_compression("fp32" if lossless else outer.codec),
    )
