"""Who takes part in a run: peer identities bound to the keys that sign their records, and private runs.

Identity. A unit's libp2p identity is an RSA key, and the same key signs the unit's DHT records
(``RSASignatureValidator``), so the peer id a record names is checked against the key that signed it
(:class:`RunRecordValidator`): nobody can publish a record in another peer's name.

Private runs. The run's owner holds a run key (an RSA key file like an identity, made by ``p2p-diloco run-key``) and
admits a peer by signing ``(run id, peer id)`` with it (``p2p-diloco admit``): an :class:`Admission`, one line of text
the volunteer passes with ``--admission``. The run key's public part, inside every admission, identifies the run. Every
member of a private run

- refuses the run's DHT records (progress, members) whose signer is not admitted (:class:`RunRecordValidator`, on
  store and on read), and
- refuses matchmaking requests, groups and state downloads with a peer that is not admitted, judged by the caller's
  libp2p-authenticated peer id (:class:`MemberGate`, asked by the averagers' RPC handlers).

Why signed peer ids and not a shared secret: a secret every member holds can be passed on by any member, cannot be
withdrawn from one peer, and must be proven on every request; an admission names one libp2p identity, which libp2p
authenticates on every connection, so a copied admission is useless without that peer's private key, and checking a
caller is one signature check of a record the caller published. What it does not give: revocation (an admitted peer
stays admitted for the run key's life; make a new run key to exclude one), and a private DHT (non-members still route
DHT requests and may store keys outside the run's schema; no record of the run from them is accepted).
"""

from __future__ import annotations

import base64
import binascii
import copy
import ctypes
import hashlib
import logging
import multiprocessing
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import base58
from cryptography.hazmat.primitives import serialization
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.errors import UserError

logger = logging.getLogger(__name__)

ADMISSION_PREFIX = "p2p-diloco-admission-v1:"
MISS_REREAD_S = 1.0
"""A caller the gate did not find triggers a new read of the members' records at most this often."""
REFUSALS_BYTES = 64 * 1024
_OWNER_RE = re.compile(re.escape(b"[owner:") + rb"(.+?)" + re.escape(b"]"))


class MembershipError(UserError):
    """A run key, an identity or an admission cannot be used; the message is one line meant for the user."""


class IdentityKey(RSAPrivateKey):
    """A libp2p RSA identity as a record-signing key (hivemind's ``RSAPrivateKey()`` only makes new keys)."""

    def __init__(self, der: bytes) -> None:
        self._private_key = serialization.load_der_private_key(der, password=None)


def load_identity_key(path: Path) -> IdentityKey:
    """The RSA key of the libp2p identity (or run key) file at ``path``; MembershipError if unreadable or not RSA."""
    try:
        protobuf = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        if protobuf.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        return IdentityKey(protobuf.data)
    except OSError as error:
        raise MembershipError(f"cannot read key file {path}: {error.strerror}") from None
    except Exception:  # protobuf / DER decoding errors
        raise MembershipError(f"{path} is not an RSA key file made by p2p-diloco or libp2p") from None


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The base58 libp2p peer id of an RSA public key (libp2p's peer-id spec: sha2-256 multihash of the key)."""
    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest = hashlib.sha256(crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()).digest()
    return base58.b58encode(bytes([0x12, len(digest)]) + digest).decode()


def owner_peer_id(record: DHTRecord) -> str | None:
    """The peer id of the key that owns ``record``'s subkey (and signed it), or None for an unowned or malformed one."""
    owners = set(_OWNER_RE.findall(record.subkey or b""))
    if len(owners) != 1:
        return None
    try:
        return peer_id_of(RSAPublicKey.from_bytes(owners.pop()))
    except Exception:  # a malformed key; the signature validator refuses such a record too
        return None


def _admission_message(run_id: str, peer_id: str) -> bytes:
    return f"{ADMISSION_PREFIX}{run_id}:{peer_id}".encode()


@dataclass(frozen=True)
class Admission:
    """The run key's signature admitting ``peer_id`` to ``run_id``; ``run_key`` is the run key's public part."""

    run_id: str
    peer_id: str
    run_key: bytes  # OpenSSH encoding of the run's RSA public key
    signature: bytes

    @classmethod
    def issue(cls, run_key: RSAPrivateKey, run_id: str, peer_id: str) -> Admission:
        public = run_key.get_public_key().to_bytes()
        return cls(run_id, peer_id, public, run_key.sign(_admission_message(run_id, peer_id)))

    def to_text(self) -> str:
        packed = MSGPackSerializer.dumps([self.run_id, self.peer_id, self.run_key, self.signature])
        return ADMISSION_PREFIX + base64.urlsafe_b64encode(packed).decode()

    @classmethod
    def from_text(cls, text: str) -> Admission:
        """Parse :meth:`to_text`'s form; ValueError for anything else."""
        text = text.strip()
        if not text.startswith(ADMISSION_PREFIX):
            raise ValueError("not an admission")
        try:
            fields = MSGPackSerializer.loads(base64.urlsafe_b64decode(text[len(ADMISSION_PREFIX) :]))
        except (binascii.Error, ValueError, TypeError):
            raise ValueError("a corrupted admission") from None
        if not (isinstance(fields, list) and [type(value) for value in fields] == [str, str, bytes, bytes]):
            raise ValueError("a corrupted admission")
        return cls(*fields)

    @property
    def run_key_id(self) -> str:
        """A short name of the run key (its peer id), to compare with what the owner printed."""
        return peer_id_of(RSAPublicKey.from_bytes(self.run_key))

    def admits(self, run_key: bytes, run_id: str, peer_id: str) -> bool:
        """True when this is the run key ``run_key``'s valid signature admitting ``peer_id`` to ``run_id``."""
        if (self.run_key, self.run_id, self.peer_id) != (run_key, run_id, peer_id):
            return False
        try:
            public = RSAPublicKey.from_bytes(run_key)
        except Exception:
            return False
        return public.verify(_admission_message(run_id, peer_id), self.signature)


@dataclass(frozen=True)
class RunAccess:
    """Who may take part in ``run_id``: everyone (``run_key`` None, an open run) or the run key's admitted peers.
    ``admission`` is this peer's own (text; "" in an open run)."""

    run_id: str
    run_key: bytes | None = None
    admission: str = ""

    @property
    def private(self) -> bool:
        return self.run_key is not None

    def admits(self, peer_id: str, admission: Any) -> bool:
        """Whether ``peer_id``, presenting ``admission`` (text, from a record), may take part."""
        if self.run_key is None:
            return True
        if not isinstance(admission, str):
            return False
        try:
            return Admission.from_text(admission).admits(self.run_key, self.run_id, peer_id)
        except ValueError:
            return False


def load_run_access(run_id: str, admission_path: str | None, peer_id: str | None) -> RunAccess:
    """The access rules of this peer: an open run without ``admission_path``; else the private run its admission names.

    Raises MembershipError (one line) for an unreadable or corrupted admission, one for another run id, one whose
    signature is wrong, or one that does not admit ``peer_id`` (this peer's identity; None for a peer that only reads
    the run's records, such as ``p2p-diloco status``).
    """
    if admission_path is None:
        return RunAccess(run_id)
    try:
        text = Path(admission_path).read_text().strip()
    except OSError as error:
        raise MembershipError(f"cannot read admission file {admission_path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise MembershipError(f"admission file {admission_path} is not text") from None
    try:
        admission = Admission.from_text(text)
    except ValueError as error:
        raise MembershipError(
            f"admission file {admission_path} holds {error} (make one with p2p-diloco admit)"
        ) from None
    if admission.run_id != run_id:
        raise MembershipError(f"admission {admission_path} is for run '{admission.run_id}', not '{run_id}'")
    if peer_id is not None and admission.peer_id != peer_id:
        raise MembershipError(
            f"admission {admission_path} admits peer {admission.peer_id}, but this identity is {peer_id} "
            "(pass the --identity-path the admission was made for)"
        )
    if not admission.admits(admission.run_key, run_id, admission.peer_id):
        raise MembershipError(f"admission {admission_path} has an invalid signature")
    return RunAccess(run_id, admission.run_key, text)


class RunRecordValidator(RecordValidatorBase):
    """Refuses a record under one of ``keys`` (full DHT key names) unless its ``peer_id`` field is the peer id of the
    key that signed it and, in a private run, its ``admission`` field admits that peer.

    Runs after ``RSASignatureValidator`` (which proved the signer owns the subkey) and before the schema validator.
    A deletion (value None) is the owner's business and passes.
    """

    def __init__(self, access: RunAccess, keys: tuple[str, ...]) -> None:
        self.access = access
        self._key_ids = {DHTID.generate(source=key).to_bytes(): key for key in keys}

    def validate(self, record: DHTRecord) -> bool:
        key = self._key_ids.get(record.key)
        if key is None:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        if value is None:
            return True
        owner = owner_peer_id(record)
        if not isinstance(value, dict) or owner is None or value.get("peer_id") != owner:
            logger.debug("record refused key=%s: peer_id is not its signer's (%s)", key, owner)
            return False
        if not self.access.admits(owner, value.get("admission")):
            logger.debug("record refused key=%s: %s is not a member", key, owner)
            return False
        return True

    @property
    def priority(self) -> int:
        return 5  # after RSASignatureValidator (10) strips the signature, before the schema (0)


class SharedPeerSet:
    """Peer ids added by any process of one unit: a shared-memory list, made in the unit's main process before its
    averager processes fork from it (hivemind's averagers are forked processes), so a member refused by one of the
    unit's averagers is refused by all of them. Holds about REFUSALS_BYTES / 47 peer ids; beyond that, an addition
    holds only in the process that made it (logged)."""

    def __init__(self) -> None:
        self._shared = multiprocessing.Array(ctypes.c_char, REFUSALS_BYTES)
        self._local: set[str] = set()

    def add(self, peer_id: str) -> None:
        self._local.add(peer_id)
        entry = peer_id.encode() + b"\n"
        with self._shared.get_lock():
            listed = self._shared.value
            if entry in listed:
                return
            if len(listed) + len(entry) < REFUSALS_BYTES:
                self._shared.value = listed + entry
                return
        logger.warning("%s not shared with the unit's other averagers: the list is full", peer_id)

    def __contains__(self, peer_id: str) -> bool:
        if peer_id in self._local:
            return True
        with self._shared.get_lock():
            return peer_id.encode() + b"\n" in self._shared.value


class MemberGate:
    """Answers, inside an averager process, whether a caller (by its authenticated peer id) is a member of the run.

    In an open run everyone is. In a private run a member is a peer whose members record (validated by
    :class:`RunRecordValidator`, and checked again here) is in the DHT under ``members_key``. An admission cannot be
    withdrawn, so a member found once stays one; a caller not found triggers a new read at most every MISS_REREAD_S.
    Refusals (:meth:`refuse`) and suspicions (:meth:`suspect`) are shared by every process forked after the gate was
    made (:class:`SharedPeerSet`); the view :meth:`shunning_suspects` also refuses suspects.
    """

    def __init__(self, access: RunAccess, members_key: str) -> None:
        self.access, self.members_key = access, members_key
        self._members: set[str] = set()
        self._refused, self._suspected = SharedPeerSet(), SharedPeerSet()
        self._shuns_suspects = False
        self._last_read = -float("inf")

    def suspect(self, peer_id: str) -> None:
        """Note that ``peer_id`` offended once (not yet refused: see gated.py) in every process of this unit."""
        self._suspected.add(peer_id)

    def shunning_suspects(self) -> MemberGate:
        """A view of this gate (same members, refusals and suspicions) that also refuses every suspect: for rounds
        where one member's part can decide the result, e.g. a unit's settle rounds at exit, often in pairs."""
        view = copy.copy(self)
        view._shuns_suspects = True
        return view

    def refuse(self, peer_id: str) -> None:
        """Refuse ``peer_id`` from now on, member or not (a member that kept sending parts out of bounds), in every
        process of this unit."""
        self._refused.add(peer_id)

    def refused(self, peer_id: str) -> bool:
        return peer_id in self._refused or (self._shuns_suspects and peer_id in self._suspected)

    @classmethod
    def everyone(cls) -> MemberGate:
        """The gate of an open run."""
        return cls(RunAccess(run_id=""), members_key="")

    async def admits(self, peer_id: Any, dht: Any) -> bool:
        """Whether ``peer_id`` (a hivemind PeerID) may take part; reads the DHT through ``dht`` when needed.
        A failed read counts as "not found" (the caller retries its request later)."""
        name = peer_id.to_base58()
        if self.refused(name):
            return False
        if not self.access.private:
            return True
        if name not in self._members and time.monotonic() - self._last_read >= MISS_REREAD_S:
            self._last_read = time.monotonic()
            await self._read(dht)
        return name in self._members

    async def _read(self, dht: Any) -> None:
        try:
            found = await dht.get(self.members_key, latest=True, return_future=True)
        except Exception as error:
            logger.warning("members' records not readable: %s", error or type(error).__name__)
            return
        if found is None or not isinstance(found.value, dict):
            return
        for item in found.value.values():
            value = item.value if isinstance(item, ValueWithExpiration) else None
            if isinstance(value, dict) and isinstance(value.get("peer_id"), str):
                if self.access.admits(value["peer_id"], value.get("admission")):
                    self._members.add(value["peer_id"])
