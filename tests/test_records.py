"""Typed, signed, expiring swarm records between real DHT nodes on 127.0.0.1, and the status table."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from concurrent.futures import Future

import pytest
from hivemind.utils import get_dht_time
from swarms import record_peers

from bench.swarm import wait_until
from p2p_diloco.config import NetworkSection
from p2p_diloco.network import records
from p2p_diloco.network.dht import stop_dht, visible_multiaddrs
from p2p_diloco.network.membership import RunAccess
from p2p_diloco.network.records import (
    ModelClaim,
    PeerProgress,
    PendingRead,
    SwarmRecords,
    in_phase,
    latest_progress,
)
from p2p_diloco.ops import status
from p2p_diloco.ops.status import format_table, run_status

pytestmark = pytest.mark.swarm

RUN_ID = "records-test"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


def progress(peer_id: str, **overrides) -> PeerProgress:
    fields = dict(
        peer_id=peer_id,
        inner_step=12,
        outer_round=3,
        tokens_per_s=1500.5,
        loss=2.75,
        last_seen=get_dht_time(),
        group_size=2,
        model_fingerprint="sha256:abc",
    )
    return PeerProgress(**{**fields, **overrides})


@pytest.fixture
def swarm():
    """Two DHT servers of an open run (the second joined through the first), each signing with its identity."""
    with record_peers(2, lambda _index, _peer_id: RunAccess(RUN_ID)) as (first, second):
        yield first, second


def ids(*peers: SwarmRecords) -> list[str]:
    return [str(peer.dht.peer_id) for peer in peers]


def test_progress_round_trip_between_peers(swarm):
    a, b = swarm
    pa, pb = ids(a, b)
    mine = progress(pa)
    a.publish_progress(mine, wait=True)
    wait_until(lambda: pa in b.read_progress(), 10, "peer-a's record on peer b")
    assert b.read_progress()[pa] == mine
    b.publish_progress(progress(pb, inner_step=0, tokens_per_s=0), wait=True)
    wait_until(lambda: set(a.read_progress()) == {pa, pb}, 10, "both records on peer a")


def test_a_record_of_another_phase_replaces_the_last_one(swarm):
    a, b = swarm
    pa, pb = ids(a, b)
    a.publish_progress(progress(pa), wait=True)
    b.publish_progress(progress(pb), wait=True)
    wait_until(lambda: set(in_phase(b.read_progress(), "training")) == {pa, pb}, 10, "both records")
    a.publish_progress(progress(pa, phase="left"), wait=True)
    wait_until(lambda: set(in_phase(b.read_progress(), "training")) == {pb}, 10, "peer-a's last record")
    assert set(in_phase(b.read_progress(), "left")) == {pa}


def test_progress_read_without_waiting(swarm):
    """``read_progress_soon`` returns a read to poll; once over, it holds what ``read_progress`` returns."""
    a, b = swarm
    pa, pb = ids(a, b)
    a.publish_progress(progress(pa), wait=True)
    wait_until(lambda: pa in b.read_progress(), 10, "peer-a's record on peer b")
    pending = b.read_progress_soon()
    found: list[dict[str, PeerProgress]] = []
    wait_until(lambda: found.append(pending.poll()) or found[-1] is not None, 10, "the read to end")
    assert found[-1] == b.read_progress()


def test_unanswered_read_counts_as_empty(monkeypatch, caplog):
    """A read still pending after ``DHT_TIMEOUT_S`` is over and empty, with a warning; before that, pending."""
    never_answered: Future = Future()
    pending = PendingRead(never_answered, "key", latest_progress)
    assert pending.poll() is None
    monkeypatch.setattr(records, "DHT_TIMEOUT_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.network.records"):
        assert pending.poll() == {}
    assert "dht get failed key=key" in caplog.text


def test_forged_and_malformed_records_are_rejected(swarm):
    a, b = swarm
    pa, pb = ids(a, b)
    original = progress(pa)
    a.publish_progress(original, wait=True)
    wait_until(lambda: pa in b.read_progress(), 10, "peer-a's record")
    expiration = get_dht_time() + 60
    key = a.progress_key

    forged = dict(original.dict(), loss=0.0)
    assert not b.dht.store(key, forged, expiration, subkey=a._subkey), "b overwrote a's signed subkey"
    malformed = [
        original.dict(),  # b's own subkey, naming a: refused (the peer id is not its signer's)
        dict(original.dict(), peer_id=pb, inner_step=-1),
        dict(original.dict(), peer_id=pb, inner_step=1.0),  # a float where an int belongs
        dict(original.dict(), peer_id=pb, extra_field=1),
        {"peer_id": pb},
    ]
    for value in malformed:
        assert not b.dht.store(key, value, expiration, subkey=b._subkey), value
    assert not b.dht.store(key, original.dict(), expiration, subkey=b"no-owner-key"), "unsigned subkey accepted"
    assert not b.dht.store(a.model_key, 42, expiration), "non-string fingerprint accepted"

    for reader in (a, b):
        assert reader.read_progress() == {pa: original}


def test_expired_records_disappear(swarm):
    a, b = swarm
    pa, pb = ids(a, b)
    a.publish_progress(progress(pa), ttl_s=1.5, wait=True)
    assert pa in a.read_progress()
    wait_until(lambda: pa not in a.read_progress() and pa not in b.read_progress(), 10, "expiry")


def test_first_fingerprint_claim_wins(swarm):
    a, b = swarm
    assert a.claim_model_fingerprint("fp-first", ttl_s=30) == ModelClaim("fp-first", earlier=False)
    assert b.claim_model_fingerprint("fp-second", ttl_s=30) == ModelClaim("fp-first", earlier=True)
    b.refresh_model_fingerprint("fp-first", ttl_s=60)
    assert a.claim_model_fingerprint("fp-third") == ModelClaim("fp-first", earlier=True)


def test_publish_on_a_dead_dht_only_warns(swarm, caplog):
    a, _ = swarm
    (pa,) = ids(a)
    stop_dht(a.dht)
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.network.records"):
        a.publish_progress(progress(pa), wait=True)
        assert a.read_progress() == {}
        assert a.read_progress_soon().poll() in (None, {})
    assert "dht store failed" in caplog.text and "dht get failed" in caplog.text


def test_progress_model_is_strict():
    assert progress("p", tokens_per_s=3).tokens_per_s == 3.0
    for bad in (
        dict(inner_step=True),
        dict(inner_step="3"),
        dict(loss=float("nan")),
        dict(tokens_per_s=-1.0),
        dict(model_fingerprint=""),
        dict(model_fingerprint="x" * 129),
        dict(phase="gone"),
        dict(phase=1),
    ):
        with pytest.raises(ValueError):
            progress("p", **bad)
    with pytest.raises(ValueError):
        progress("")
    with pytest.raises(ValueError):
        PeerProgress(**{**progress("p").dict(), "unknown": 1})


def test_goodput_fields_default_to_zero_and_must_be_finite():
    older = {
        name: value for name, value in progress("p").dict().items() if name not in ("useful_compute_s", "allocated_s")
    }
    parsed = PeerProgress.parse_obj(older)  # a record of a peer from before goodput accounting
    assert parsed.useful_compute_s == 0.0 and parsed.allocated_s == 0.0
    converted = progress("p", useful_compute_s=3, allocated_s=4)
    assert (converted.useful_compute_s, converted.allocated_s) == (3.0, 4.0)
    assert type(converted.useful_compute_s) is float and type(converted.allocated_s) is float
    for field in ("useful_compute_s", "allocated_s"):
        for bad in (float("nan"), float("inf"), -1.0, "1.0", True):
            with pytest.raises(ValueError):
                progress("p", **{field: bad})


def test_format_table_shows_each_peers_goodput_and_the_swarm_goodput_of_live_peers():
    now = 1000.0
    rows = [
        progress("peer-a", last_seen=now, useful_compute_s=93.1, allocated_s=100.0),
        progress("peer-b", last_seen=now - 10, useful_compute_s=50.0, allocated_s=100.0),
        progress("peer-c", last_seen=now, useful_compute_s=0.0, allocated_s=0.0),  # an older peer: nothing reported
        progress("peer-d", last_seen=now - 120, useful_compute_s=0.0, allocated_s=900.0),  # stale: not counted
        progress("peer-e", last_seen=now, useful_compute_s=0.0, allocated_s=900.0, phase="left"),  # left: neither
    ]
    lines = format_table(rows, now, stale_after_s=60).splitlines()
    assert lines[0].split()[-1] == "goodput"
    assert [line.split()[-1] for line in lines[1:6]] == ["93.1%", "50.0%", "n/a", "0.0%", "0.0%"]
    assert "(stale)" in lines[4] and "(left)" in lines[5]
    assert lines[6] == "swarm goodput: 71.5% over 3 live peers (useful compute / allocated peer-time)"
    assert lines[7] == "swarm consensus: n/a (no live peer reports a model probe)"
    only_stale = format_table(rows[3:], now, stale_after_s=60).splitlines()[-2]
    assert only_stale == "swarm goodput: n/a over 0 live peers (useful compute / allocated peer-time)"


def test_status_prints_table_of_live_peers(swarm, capsys, monkeypatch):
    a, b = swarm
    pa, pb = ids(a, b)
    a.publish_progress(progress(pa), wait=True)
    b.publish_progress(progress(pb, last_seen=get_dht_time() - 120), wait=True)
    wait_until(lambda: len(a.read_progress()) == 2, 10, "both records")
    network = NetworkSection(run_id=RUN_ID, initial_peers=visible_multiaddrs(a.dht))
    assert run_status(network, stale_after_s=60) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["peer", "inner", "step"]
    rows = {line.split()[0]: line for line in out[1:3]}
    assert "1500.5" in rows[pa] and "2.7500" in rows[pa] and "(stale)" not in rows[pa]
    assert "(stale)" in rows[pb]
    assert out[3].startswith("swarm goodput: n/a over 1 live peers")

    empty = NetworkSection(run_id="nobody-here", initial_peers=visible_multiaddrs(a.dht))
    monkeypatch.setattr(status, "EMPTY_REREAD_S", 2.0)  # read again before saying so (the run may be there)
    started = time.monotonic()
    assert run_status(empty) == 1
    assert time.monotonic() - started >= 2.0
    assert "no peer of run 'nobody-here'" in capsys.readouterr().err


class _StopAfter(io.StringIO):
    """Output that sets ``stop`` once ``reads`` reads were printed."""

    def __init__(self, stop: threading.Event, reads: int):
        super().__init__()
        self.stop, self.reads = stop, reads

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.getvalue().count("\n") >= self.reads:  # one line per read
            self.stop.set()
        return written


def test_status_watch_prints_one_json_object_per_read_until_stopped(swarm):
    a, b = swarm
    pa, pb = ids(a, b)
    a.publish_progress(progress(pa, eval_loss=3.5), wait=True)
    b.publish_progress(progress(pb, phase="left"), wait=True)
    wait_until(lambda: len(a.read_progress()) == 2, 10, "both records")
    stop = threading.Event()
    out = _StopAfter(stop, reads=2)
    network = NetworkSection(run_id=RUN_ID, initial_peers=visible_multiaddrs(a.dht))
    assert run_status(network, as_json=True, watch_s=0.05, stop=stop, out=out) == 0
    snapshots = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(snapshots) == 2
    peers = {peer["peer_id"]: peer for peer in snapshots[-1]["peers"]}
    assert peers[pa]["state"] == "live" and peers[pa]["eval_loss"] == 3.5 and peers[pb]["state"] == "left"
    assert snapshots[-1]["swarm"]["live_peers"] == 1 and snapshots[-1]["swarm"]["eval_loss"] == 3.5


def test_open_runs_list_themselves_in_the_directory_of_runs_and_private_ones_do_not():
    """A unit of another run reads which runs have units training (the hint for a typo in --run-id)."""

    def access(index: int, _peer_id: str) -> RunAccess:
        return RunAccess(("tiny", "other", "private")[index], run_key=b"k" * 32 if index == 2 else None)

    with record_peers(3, access) as peers:
        tiny, other, private = peers
        tiny.list_run()
        private.list_run()

        seen: dict = {}

        def listed_tiny() -> bool:
            pending = other.read_runs_soon()
            wait_until(lambda: seen.update(runs=pending.poll()) or seen["runs"] is not None, 15, "a read's end")
            return "tiny" in seen["runs"]

        wait_until(listed_tiny, 10, "the run's listing")
        assert set(seen["runs"]) == {"tiny"} and seen["runs"]["tiny"].last_seen > 0
