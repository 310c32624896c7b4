"""Typed, signed, expiring DHT records of one run: per-peer progress and the swarm's model fingerprint.

Keys are namespaced by run id: ``{run_id}_progress`` holds one subkey per peer, and that subkey carries the peer's
RSA public key, so only its owner can write it (``RSASignatureValidator``); ``{run_id}_model`` holds the fingerprint
of the model the swarm trains. ``SchemaValidator`` rejects malformed values on store and on read, so they never
reach honest peers. The ``peer_id`` inside a progress record is self-declared (not bound to the signing key).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal, Protocol

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

logger = logging.getLogger(__name__)

DHT_TIMEOUT_S = 10.0
"""Bound on one store or get of a record; on expiry the call gives up (the DHT request itself may go on)."""

if TYPE_CHECKING:  # pydantic.v1's constrained types are calls, which a type checker cannot read as types
    _SHORT_TEXT = str
    _COUNT = int
    _NON_NEGATIVE = float
else:
    _SHORT_TEXT = pydantic.constr(strict=True, min_length=1, max_length=128)
    _COUNT = pydantic.conint(strict=True, ge=0)
    _NON_NEGATIVE = pydantic.confloat(strict=True, ge=0.0)
Phase = Literal["training", "finishing", "left"]
"""Where a unit is in its life, as its progress record says."""
_FLOAT_FIELDS = ("tokens_per_s", "loss", "last_seen", "useful_compute_s", "allocated_s")


class PeerProgress(pydantic.BaseModel):
    """What one learning unit reports about itself (a few hundred bytes once serialized).

    Floats must be finite (``loss`` too: NaN never equals itself, so the DHT's schema check would drop it);
    integers given for float fields are converted.
    """

    peer_id: _SHORT_TEXT
    inner_step: _COUNT
    outer_round: _COUNT
    tokens_per_s: _NON_NEGATIVE
    loss: _NON_NEGATIVE
    last_seen: _NON_NEGATIVE
    group_size: _COUNT
    model_fingerprint: _SHORT_TEXT
    useful_compute_s: _NON_NEGATIVE = 0.0  # goodput numerator (p2p_diloco/goodput.py); 0.0 from older peers
    allocated_s: _NON_NEGATIVE = 0.0  # goodput denominator; 0.0 from older peers
    phase: Phase = "training"  # "finishing": in its final and settle rounds; "left": its last record

    class Config:
        extra = pydantic.Extra.forbid

    @pydantic.validator(*_FLOAT_FIELDS, pre=True)
    def _int_to_float(cls, value: Any) -> Any:
        return float(value) if type(value) is int else value

    @pydantic.validator(*_FLOAT_FIELDS)
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be finite")
        return value


class _RunSchema(pydantic.BaseModel):
    """Schema of the DHT keys of one run (``SchemaValidator`` prefixes each field with ``{run_id}_``)."""

    progress: dict[BytesWithPublicKey, PeerProgress | None]
    model: _SHORT_TEXT


def record_validators(run_id: str, private_key: RSAPrivateKey | None = None) -> list:
    """Validators to pass to ``start_dht``: the schema of ``run_id``'s keys and record signatures.

    Records are signed with ``private_key``, by default the process-wide key that other hivemind components share;
    several DHT nodes in one process (tests) need one key each to own distinct subkeys.
    """
    return [SchemaValidator(_RunSchema, prefix=run_id), RSASignatureValidator(private_key)]


class ProgressRecords(Protocol):
    """What a learning unit needs of the run's records (SwarmRecords; tests/fakes.py has an in-memory one)."""

    def publish_progress(self, progress: PeerProgress, ttl_s: float = 60, wait: bool = False) -> None: ...

    def read_progress(self) -> dict[str, PeerProgress]: ...

    def read_progress_soon(self) -> PendingProgress: ...

    def refresh_model_fingerprint(self, fingerprint: str, ttl_s: float = 3600) -> None: ...


class PendingProgress:
    """A read of the progress records that may not have finished: :meth:`poll` never blocks.

    ``found`` is the DHT get's future, whose value ``records`` turns into the records (by default
    :func:`latest_progress`); a read that failed, or is not done ``DHT_TIMEOUT_S`` after it began, counts as an
    empty one (with a warning), like ``read_progress``.
    """

    def __init__(
        self, found: Future, key: str, records: Callable[[Any], dict[str, PeerProgress]] | None = None
    ) -> None:
        self._found, self._key, self._began = found, key, time.monotonic()
        self._records = records or latest_progress

    def poll(self) -> dict[str, PeerProgress] | None:
        """The unexpired, well-formed records by peer id once the read is over, else None."""
        if not self._found.done():
            if time.monotonic() - self._began < DHT_TIMEOUT_S:
                return None
            logger.warning("dht get failed key=%s error=no answer in %.0f s", self._key, DHT_TIMEOUT_S)
            return {}
        try:
            return self._records(self._found.result())
        except Exception as error:
            logger.warning("dht get failed key=%s error=%s", self._key, error or type(error).__name__)
            return {}


def in_phase(records: dict[str, PeerProgress], *phases: Phase) -> dict[str, PeerProgress]:
    """The records of units in one of ``phases`` (a unit's record outlives it until it expires, saying "left")."""
    return {peer_id: record for peer_id, record in records.items() if record.phase in phases}


def latest_progress(found: hivemind.utils.ValueWithExpiration | None) -> dict[str, PeerProgress]:
    """The unexpired, well-formed progress records of a DHT get's value, by peer id (the freshest one if a peer id
    appears twice); malformed entries are dropped (logged at debug level)."""
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    latest: dict[str, PeerProgress] = {}
    for subkey, item in found.value.items():
        try:
            progress = PeerProgress.parse_obj(item.value)
        except (pydantic.ValidationError, TypeError) as error:
            logger.debug("record dropped subkey=%r error=%s", subkey[:32], error)
            continue
        if item.expiration_time > now and (
            progress.peer_id not in latest or progress.last_seen > latest[progress.peer_id].last_seen
        ):
            latest[progress.peer_id] = progress
    return latest


class SwarmRecords:
    """Reads and writes the records of run ``run_id`` through ``dht``.

    ``validators`` must be the list given to ``start_dht`` (it holds the signing key); if None, fresh validators
    are added to the running DHT.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, validators: list | None = None):
        if validators is None:
            validators = record_validators(run_id)
            dht.add_validators(validators)
        signers = [validator for validator in validators if isinstance(validator, RSASignatureValidator)]
        if not signers:
            raise ValueError("validators must include an RSASignatureValidator (use record_validators(run_id))")
        self.dht, self.run_id = dht, run_id
        self.progress_key, self.model_key = f"{run_id}_progress", f"{run_id}_model"
        self._subkey = signers[0].local_public_key

    def publish_progress(self, progress: PeerProgress, ttl_s: float = 60, wait: bool = False) -> None:
        """Store ``progress`` under this peer's signed subkey for ``ttl_s`` seconds. Never raises on network
        failures: logs a warning instead. Returns at once unless ``wait`` (then blocks at most ``DHT_TIMEOUT_S``),
        so a training loop never waits on the DHT."""
        self._store(self.progress_key, progress.dict(), ttl_s, subkey=self._subkey, wait=wait)

    def read_progress(self) -> dict[str, PeerProgress]:
        """Unexpired, well-formed progress records by peer id (the freshest one if a peer id appears twice).

        Blocks at most ``DHT_TIMEOUT_S``; returns an empty dict, with a warning, when the DHT cannot be read.
        """
        return latest_progress(self._get(self.progress_key))

    def read_progress_soon(self) -> PendingProgress:
        """Start reading the progress records and return at once (a training loop polls the read)."""
        found: Future = Future()
        try:
            found = self.dht.get(self.progress_key, latest=True, return_future=True)
        except Exception as error:  # reported by the read's poll, like any failed get
            found.set_exception(error)
        return PendingProgress(found, self.progress_key)

    def claim_model_fingerprint(self, fingerprint: str, ttl_s: float = 3600) -> str:
        """Return the swarm's model fingerprint: the one already published if any, else ``fingerprint`` (stored).

        Concurrent first claims are settled by the DHT (the record with the later expiration wins); the value read
        back is returned, so both claimants agree. If the DHT is unreachable, returns ``fingerprint`` with a warning.
        """
        found = self._get(self.model_key)
        if found is not None and isinstance(found.value, str):
            return found.value
        self.refresh_model_fingerprint(fingerprint, ttl_s, wait=True)
        found = self._get(self.model_key)
        if found is None or not isinstance(found.value, str):
            logger.warning("fingerprint not readable after store key=%s, assuming ours", self.model_key)
            return fingerprint
        return found.value

    def refresh_model_fingerprint(self, fingerprint: str, ttl_s: float = 3600, wait: bool = False) -> None:
        """Re-publish the swarm's fingerprint so it outlives its first claimant; call it periodically (< ttl_s).
        Returns at once unless ``wait``."""
        self._store(self.model_key, fingerprint, ttl_s, wait=wait)

    def _store(self, key: str, value: Any, ttl_s: float, subkey: bytes | None = None, wait: bool = True) -> None:
        try:
            future = self.dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey, return_future=True)
        except Exception as error:  # network hiccups must not stop training
            logger.warning("dht store failed key=%s error=%s", key, error or type(error).__name__)
            return
        if wait:
            try:
                future.result(timeout=DHT_TIMEOUT_S)
            except Exception:  # reported below, like a store nobody accepted
                pass
        future.add_done_callback(lambda done: _warn_if_not_stored(key, done))

    def _get(self, key: str) -> hivemind.utils.ValueWithExpiration | None:
        try:
            return self.dht.get(key, latest=True, return_future=True).result(timeout=DHT_TIMEOUT_S)
        except Exception as error:
            logger.warning("dht get failed key=%s error=%s", key, error or type(error).__name__)
            return None


def _warn_if_not_stored(key: str, future: Any) -> None:
    """Done-callback of a DHT store: a warning when it failed or no peer accepted the record."""
    if future.cancelled() or future.exception() is not None:
        logger.warning("dht store failed key=%s error=%s", key, future.exception() if not future.cancelled() else "")
    elif not future.result():
        logger.warning("dht store not accepted key=%s (no peer stored it, or a newer value exists)", key)
