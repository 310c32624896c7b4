"""Typed, signed, expiring DHT records of one run: per-peer progress and the swarm's model fingerprint.

Keys are namespaced by run id: ``{run_id}_progress`` holds one subkey per peer, and that subkey carries the peer's
RSA public key, so only its owner can write it (``RSASignatureValidator``); ``{run_id}_members`` holds, the same way,
the admission of every member of a private run; ``{run_id}_model`` holds the fingerprint of the model the swarm
trains. ``SchemaValidator`` rejects malformed values and ``RunRecordValidator`` (membership.py) records whose
``peer_id`` is not their signer's, or whose signer a private run did not admit, on store and on read, so they never
reach honest peers. A unit signs with its libp2p identity's key, so the two peer ids are the same.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import hivemind
import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.consensus import RECORD_PROBE_SIZE
from p2p_diloco.network.membership import RunAccess, RunRecordValidator
from p2p_diloco.rounds.departure import Phase

logger = logging.getLogger(__name__)

DHT_TIMEOUT_S = 10.0
"""Bound on one store or get of a record; on expiry the call gives up (the DHT request itself may go on)."""

if TYPE_CHECKING:  # pydantic.v1's constrained types are calls, which a type checker cannot read as types
    _SHORT_TEXT = str
    _COUNT = int
    _NON_NEGATIVE = float
    _ADMISSION_TEXT = str
    _STATE_KEY = str
    _DIGEST = str
    _ROUNDS = list[int]
    _PROBE = list[float]
    _SETTINGS = str
    _RUN_ID = str
else:
    _SHORT_TEXT = pydantic.constr(strict=True, min_length=1, max_length=128)
    _COUNT = pydantic.conint(strict=True, ge=0)
    _NON_NEGATIVE = pydantic.confloat(strict=True, ge=0.0)
    _ADMISSION_TEXT = pydantic.constr(strict=True, max_length=2048)
    _STATE_KEY = pydantic.constr(strict=True, min_length=1, max_length=512)
    _DIGEST = pydantic.constr(strict=True, regex=r"^[0-9a-f]{64}$")
    _ROUNDS = pydantic.conlist(_COUNT, min_items=1, max_items=4096)
    _PROBE = pydantic.conlist(pydantic.confloat(strict=True, allow_inf_nan=False), max_items=RECORD_PROBE_SIZE)
    _SETTINGS = pydantic.constr(strict=True, max_length=256)
    _RUN_ID = pydantic.constr(strict=True, min_length=1, max_length=64)
_FLOAT_FIELDS = ("tokens_per_s", "loss", "last_seen", "useful_compute_s", "allocated_s", "eval_loss", "period_s")


class PeerProgress(pydantic.BaseModel):
    """What one learning unit reports about itself (under 1 KB once serialized).

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
    eval_loss: _NON_NEGATIVE | None = None  # held-out loss of its φ at its last eval; None: none yet, or an older peer
    probe: _PROBE = []  # its φ at RECORD_PROBE_SIZE probe coordinates (consensus.py); []: an older peer
    period_s: _NON_NEGATIVE = 0.0  # the round period it wants (rounds/clock.py); 0.0: none, or an older peer
    admission: _ADMISSION_TEXT = ""  # a private run's admission of ``peer_id`` (membership.py); "" in an open run
    round_settings: _SETTINGS = ""  # what its rounds carry and its outer step (plan.py ``round_settings``); "": older

    class Config:
        extra = pydantic.Extra.forbid

    @pydantic.validator(*_FLOAT_FIELDS, pre=True)
    def _int_to_float(cls, value: Any) -> Any:
        return float(value) if type(value) is int else value

    @pydantic.validator(*_FLOAT_FIELDS)
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be finite")
        return value


class MemberCard(pydantic.BaseModel):
    """A member of a private run, as the averagers' gates read it (membership.py ``MemberGate``)."""

    peer_id: _SHORT_TEXT
    admission: _ADMISSION_TEXT

    class Config:
        extra = pydantic.Extra.forbid


class DonorRecord(pydantic.BaseModel):
    """A unit that serves its state (state_sync.py): under which averager prefix, at which fragment rounds, and the
    SHA-256 of the tensors it serves (the download is checked against it)."""

    peer_id: _SHORT_TEXT
    state_key: _STATE_KEY
    fragment_rounds: _ROUNDS
    digest: _DIGEST
    admission: _ADMISSION_TEXT = ""

    class Config:
        extra = pydantic.Extra.forbid

    @property
    def outer_round(self) -> int:
        return min(self.fragment_rounds)


class RunListing(pydantic.BaseModel):
    """An open run with a unit training now, in the directory of runs every unit reads (``RUNS_KEY``): how a unit that
    trains alone learns of the runs other units train in (a typo in ``--run-id`` is otherwise silent). Unsigned: a
    listing is only ever a hint in a log line."""

    run_id: _RUN_ID
    last_seen: _NON_NEGATIVE

    class Config:
        extra = pydantic.Extra.forbid


RUNS_KEY = "p2p_diloco_runs"
"""The directory of open runs: one subkey per run id, written by its units now and then (private runs stay out)."""


class _RunSchema(pydantic.BaseModel):
    """Schema of the DHT keys of one run (``SchemaValidator`` prefixes each field with ``{run_id}_``)."""

    progress: dict[BytesWithPublicKey, PeerProgress | None]
    members: dict[BytesWithPublicKey, MemberCard | None]
    donors: dict[BytesWithPublicKey, DonorRecord | None]
    model: _SHORT_TEXT


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def members_key(run_id: str) -> str:
    return f"{run_id}_members"


def donors_key(run_id: str) -> str:
    return f"{run_id}_donors"


def model_key(run_id: str) -> str:
    return f"{run_id}_model"


def run_record_keys(run_id: str) -> dict[str, str]:
    """The run's record keys by what they hold (the operator's view of the DHT)."""
    return {"progress": progress_key(run_id), "members": members_key(run_id), "donors": donors_key(run_id),
            "model": model_key(run_id)}  # fmt: skip


def record_validators(access: RunAccess, private_key: RSAPrivateKey | None = None) -> list:
    """Validators to pass to ``start_dht``: the schema of the run's keys, record signatures, and the binding of each
    record's peer id to its signer (with ``access``'s membership rule).

    Records are signed with ``private_key`` (a unit gives its libp2p identity's key, so that its records name its peer
    id), by default the process-wide key that other hivemind components share.
    """
    signed_keys = (progress_key(access.run_id), members_key(access.run_id), donors_key(access.run_id))
    return [
        SchemaValidator(_RunSchema, prefix=access.run_id),
        RSASignatureValidator(private_key),
        RunRecordValidator(access, signed_keys),
    ]


class ProgressRecords(Protocol):
    """What a learning unit needs of the run's records (SwarmRecords; tests/fakes.py has an in-memory one)."""

    def publish_progress(self, progress: PeerProgress, ttl_s: float = 60, wait: bool = False) -> None: ...

    def read_progress(self) -> dict[str, PeerProgress]: ...

    def read_progress_soon(self) -> PendingProgress: ...

    def refresh_model_fingerprint(self, fingerprint: str, ttl_s: float = 3600) -> None: ...

    def publish_membership(self, ttl_s: float = 3600, wait: bool = False) -> None: ...

    def list_run(self, ttl_s: float = 600) -> None: ...

    def read_runs_soon(self) -> PendingRead[dict[str, RunListing]]: ...


Read = TypeVar("Read")


class PendingRead(Generic[Read]):
    """A read of records that may not have finished: :meth:`poll` never blocks.

    ``found`` is the DHT get's future, whose value ``records`` turns into the records; a read that failed, or is not
    done ``DHT_TIMEOUT_S`` after it began, counts as an empty one (with a warning), like ``read_progress``.
    """

    def __init__(self, found: Future, key: str, records: Callable[[Any], Read]) -> None:
        self._found, self._key, self._began = found, key, time.monotonic()
        self._records = records

    def poll(self) -> Read | None:
        """The unexpired, well-formed records once the read is over, else None."""
        if not self._found.done():
            if time.monotonic() - self._began < DHT_TIMEOUT_S:
                return None
            logger.warning("dht get failed key=%s error=no answer in %.0f s", self._key, DHT_TIMEOUT_S)
            return self._records(None)
        try:
            return self._records(self._found.result())
        except Exception as error:
            logger.warning("dht get failed key=%s error=%s", self._key, error or type(error).__name__)
            return self._records(None)


PendingProgress = PendingRead[dict[str, PeerProgress]]
"""A read of the progress records (by peer id; :func:`latest_progress`)."""


def answered(key: str, records: Read) -> PendingRead[Read]:
    """A read that is already over with ``records`` (where no DHT is read: one process, tests)."""
    found: Future = Future()
    found.set_result(None)
    return PendingRead(found, key, lambda _found: records)


def in_phase(records: dict[str, PeerProgress], *phases: Phase) -> dict[str, PeerProgress]:
    """The records of units in one of ``phases`` (a unit's record outlives it until it expires, saying "left")."""
    return {peer_id: record for peer_id, record in records.items() if record.phase in phases}


Record = TypeVar("Record", bound=pydantic.BaseModel)


def unexpired_records(found: hivemind.utils.ValueWithExpiration | None, model: type[Record]) -> list[Record]:
    """The unexpired entries of a DHT get's dictionary value that parse as ``model``; malformed entries are dropped
    (logged at debug level)."""
    if found is None or not isinstance(found.value, dict):
        return []
    now, records = get_dht_time(), []
    for subkey, item in found.value.items():
        try:
            record = model.parse_obj(item.value)
        except (pydantic.ValidationError, TypeError) as error:
            logger.debug("record dropped subkey=%r error=%s", subkey[:32], error)
            continue
        if item.expiration_time > now:
            records.append(record)
    return records


def _listings(found: hivemind.utils.ValueWithExpiration | None) -> dict[str, RunListing]:
    return {listing.run_id: listing for listing in unexpired_records(found, RunListing)}


def latest_progress(found: hivemind.utils.ValueWithExpiration | None) -> dict[str, PeerProgress]:
    """The unexpired, well-formed progress records of a DHT get's value, by peer id (the freshest one if a peer id
    appears twice)."""
    latest: dict[str, PeerProgress] = {}
    for progress in unexpired_records(found, PeerProgress):
        if progress.peer_id not in latest or progress.last_seen > latest[progress.peer_id].last_seen:
            latest[progress.peer_id] = progress
    return latest


@dataclass(frozen=True)
class ModelClaim:
    """The fingerprint of the model a run trains, and whether another unit had claimed it before this one (a sign of
    a swarm that may be ahead, whatever its other records say)."""

    fingerprint: str
    earlier: bool


class SwarmRecords:
    """Reads and writes the records of the run ``access.run_id`` through ``dht``, as ``access`` allows.

    ``validators`` must be the list given to ``start_dht`` (``record_validators``: it holds the signing key).
    """

    def __init__(self, dht: hivemind.DHT, access: RunAccess, validators: list):
        signers = [validator for validator in validators if isinstance(validator, RSASignatureValidator)]
        if not signers:
            raise ValueError("validators must include an RSASignatureValidator (use record_validators)")
        self.dht, self.access, self.run_id = dht, access, access.run_id
        self.progress_key, self.model_key = progress_key(self.run_id), model_key(self.run_id)
        self.donors_key = donors_key(self.run_id)
        self._subkey = signers[0].local_public_key

    def publish_progress(self, progress: PeerProgress, ttl_s: float = 60, wait: bool = False) -> None:
        """Store ``progress`` (with this peer's admission in a private run) under this peer's signed subkey for
        ``ttl_s`` seconds. Never raises on network failures: logs a warning instead. Returns at once unless ``wait``
        (then blocks at most ``DHT_TIMEOUT_S``), so a training loop never waits on the DHT."""
        value = progress.copy(update={"admission": self.access.admission}).dict()
        self._store(self.progress_key, value, ttl_s, subkey=self._subkey, wait=wait)

    def publish_donor(self, donor: DonorRecord, ttl_s: float = 300) -> None:
        """Declare (signed, with this peer's admission in a private run) that this peer serves ``donor``'s state;
        returns at once, warns on failures."""
        value = donor.copy(update={"admission": self.access.admission}).dict()
        self._store(self.donors_key, value, ttl_s, subkey=self._subkey, wait=False)

    def read_donors(self, state_key: str) -> dict[str, DonorRecord]:
        """The unexpired, well-formed donor records serving ``state_key``, by peer id (blocks at most
        ``DHT_TIMEOUT_S``; empty, with a warning, when the DHT cannot be read)."""
        donors = unexpired_records(self._get(self.donors_key), DonorRecord)
        return {donor.peer_id: donor for donor in donors if donor.state_key == state_key}

    def publish_membership(self, ttl_s: float = 3600, wait: bool = False) -> None:
        """In a private run, store this peer's admission where the members' averagers look callers up (membership.py
        ``MemberGate``); call it before the first round or download, and again within ``ttl_s``. Open run: nothing."""
        if self.access.private:
            card = MemberCard(peer_id=str(self.dht.peer_id), admission=self.access.admission)
            self._store(members_key(self.run_id), card.dict(), ttl_s, subkey=self._subkey, wait=wait)

    def read_progress(self) -> dict[str, PeerProgress]:
        """Unexpired, well-formed progress records by peer id (the freshest one if a peer id appears twice).

        Blocks at most ``DHT_TIMEOUT_S``; returns an empty dict, with a warning, when the DHT cannot be read.
        """
        return latest_progress(self._get(self.progress_key))

    def read_progress_soon(self) -> PendingProgress:
        """Start reading the progress records and return at once (a training loop polls the read)."""
        return self._read_soon(self.progress_key, latest_progress)

    def list_run(self, ttl_s: float = 600) -> None:
        """Say in the directory of runs that this open run has a unit training now (a private run is never listed);
        returns at once, warns on failures."""
        if not self.access.private:
            listing = RunListing(run_id=self.run_id, last_seen=get_dht_time())
            self._store(RUNS_KEY, listing.dict(), ttl_s, subkey=self.run_id, wait=False)

    def read_runs_soon(self) -> PendingRead[dict[str, RunListing]]:
        """Start reading the directory of runs (the unexpired, well-formed listings by run id); returns at once."""
        return self._read_soon(RUNS_KEY, _listings)

    def _read_soon(self, key: str, records: Callable[[Any], Read]) -> PendingRead[Read]:
        """A DHT get of ``key`` begun without waiting, its value turned into ``records`` once polled."""
        found: Future = Future()
        try:
            found = self.dht.get(key, latest=True, return_future=True)
        except Exception as error:  # reported by the read's poll, like any failed get
            found.set_exception(error)
        return PendingRead(found, key, records)

    def claim_model_fingerprint(self, fingerprint: str, ttl_s: float = 3600) -> ModelClaim:
        """The swarm's model fingerprint: the one already published if any (``earlier``: a unit joined the run before
        this one), else ``fingerprint`` (stored).

        Concurrent first claims are settled by the DHT (the record with the later expiration wins); the value read
        back is returned, so both claimants agree. If the DHT is unreachable, returns ``fingerprint`` with a warning.
        """
        found = self._get(self.model_key)
        if found is not None and isinstance(found.value, str):
            return ModelClaim(found.value, earlier=True)
        self.refresh_model_fingerprint(fingerprint, ttl_s, wait=True)
        found = self._get(self.model_key)
        if found is None or not isinstance(found.value, str):
            logger.warning("fingerprint not readable after store key=%s, assuming ours", self.model_key)
            return ModelClaim(fingerprint, earlier=False)
        return ModelClaim(found.value, earlier=False)

    def refresh_model_fingerprint(self, fingerprint: str, ttl_s: float = 3600, wait: bool = False) -> None:
        """Re-publish the swarm's fingerprint so it outlives its first claimant; call it periodically (< ttl_s).
        Returns at once unless ``wait``."""
        self._store(self.model_key, fingerprint, ttl_s, wait=wait)

    def _store(self, key: str, value: Any, ttl_s: float, subkey: bytes | str | None = None, wait: bool = True) -> None:
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
