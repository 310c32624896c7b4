"""The commands of a private run's credentials (membership.py): the owner's run key, a peer's identity, admissions.

Each prints what the next person in the chain needs and returns 0, or raises MembershipError (one line):

1. the owner: ``p2p-diloco run-key --out run.key`` (kept secret: whoever holds it admits peers);
2. a volunteer: ``p2p-diloco identity --identity-path peer.key``, and sends the printed peer id to the owner;
3. the owner: ``p2p-diloco admit --run-key run.key --run-id NAME --peer-id <peer id> --out peer.admission``,
   and sends the admission file back;
4. the volunteer: ``p2p-diloco join ... --identity-path peer.key --admission peer.admission``.
"""

from __future__ import annotations

import os
from pathlib import Path

import base58

from p2p_diloco.network.dht import NetworkError, ensure_identity, identity_peer_id
from p2p_diloco.network.membership import Admission, MembershipError, load_identity_key, peer_id_of

SHA256_MULTIHASH = bytes([0x12, 0x20])


def run_make_run_key(path: Path) -> int:
    """Create the run key at ``path`` (an existing one is kept) and print its id."""
    try:
        existed = path.exists()
        ensure_identity(path)
    except NetworkError as error:
        raise MembershipError(str(error)) from None
    key_id = peer_id_of(load_identity_key(path).get_public_key())
    print(f"run key {path} ({'existing' if existed else 'new'}): id {key_id}")
    print(f"admit a peer with: p2p-diloco admit --run-key {path} --run-id <run id> --peer-id <its peer id>")
    return 0


def run_identity(path: Path) -> int:
    """Create the identity at ``path`` unless it exists, and print its peer id."""
    try:
        ensure_identity(path)
        print(identity_peer_id(path))
    except NetworkError as error:
        raise MembershipError(str(error)) from None
    return 0


def run_admit(run_key_path: Path, run_id: str, peer_id: str, out: Path | None) -> int:
    """Sign an admission of ``peer_id`` to ``run_id`` with the run key; write it to ``out`` (atomically) or print it."""
    check_peer_id(peer_id)
    admission = Admission.issue(load_identity_key(run_key_path), run_id, peer_id).to_text()
    if out is None:
        print(admission)
        return 0
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(admission + "\n")
        os.replace(tmp, out)
    except OSError as error:
        raise MembershipError(f"cannot write {out}: {error.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    print(f"admission of {peer_id} to run '{run_id}' written to {out}")
    return 0


def check_peer_id(peer_id: str) -> None:
    """MembershipError unless ``peer_id`` is a base58 libp2p peer id of an RSA identity (what p2p-diloco makes)."""
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raw = b""
    if len(raw) != 34 or not raw.startswith(SHA256_MULTIHASH):
        raise MembershipError(f"'{peer_id}' is not a peer id (p2p-diloco identity prints one)")
