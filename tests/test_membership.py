"""Private runs: admissions (unit), the run's records and the averagers' gate between real DHT nodes, the CLI's
credential commands and their bad input."""

from __future__ import annotations

import asyncio
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from swarms import record_peers
from test_cli_errors import assert_user_error, flags, join
from test_records import progress

from bench.swarm import wait_until
from p2p_diloco.network.dht import ensure_identity, identity_peer_id
from p2p_diloco.network.membership import (
    Admission,
    MemberGate,
    MembershipError,
    RunAccess,
    load_identity_key,
    load_run_access,
    peer_id_of,
)
from p2p_diloco.network.records import members_key
from p2p_diloco.ops.credentials import check_peer_id

RUN_ID = "private-test"
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def run_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_identity(tmp_path_factory.mktemp("owner") / "run.key")


def new_peer_id(folder: Path) -> str:
    """The peer id of a new identity in ``folder``."""
    return identity_peer_id(ensure_identity(folder / f"{len(list(folder.glob('*.key')))}.key"))


def admission_of(run_key: Path, peer_id: str, run_id: str = RUN_ID) -> Admission:
    return Admission.issue(load_identity_key(run_key), run_id, peer_id)


def test_an_admission_admits_its_peer_to_its_run_under_its_run_key_only(run_key: Path, tmp_path: Path) -> None:
    peer, other_peer = new_peer_id(tmp_path), new_peer_id(tmp_path)
    admission = Admission.from_text(admission_of(run_key, peer).to_text())
    public = admission.run_key
    assert admission.admits(public, RUN_ID, peer)
    assert admission.run_key_id == peer_id_of(load_identity_key(run_key).get_public_key())
    assert not admission.admits(public, RUN_ID, other_peer)
    assert not admission.admits(public, "another-run", peer)
    stranger_key = load_identity_key(ensure_identity(tmp_path / "stranger.key"))
    self_made = Admission.issue(stranger_key, RUN_ID, peer)  # a non-member signing its own admission
    assert not self_made.admits(public, RUN_ID, peer)
    swapped = Admission(RUN_ID, other_peer, public, admission.signature)  # another peer id under a member's signature
    assert not swapped.admits(public, RUN_ID, other_peer)
    for corrupted in ("", "p2p-diloco-admission-v1:", "p2p-diloco-admission-v1:!!!", "hello", admission.to_text()[:-8]):
        with pytest.raises(ValueError):
            Admission.from_text(corrupted)


def test_loading_an_admission_names_what_is_wrong(run_key: Path, tmp_path: Path) -> None:
    peer = new_peer_id(tmp_path)
    path = tmp_path / "peer.admission"
    assert load_run_access(RUN_ID, None, peer) == RunAccess(RUN_ID)
    with pytest.raises(MembershipError, match="cannot read admission file"):
        load_run_access(RUN_ID, str(path), peer)
    path.write_text("garbage")
    with pytest.raises(MembershipError, match="not an admission"):
        load_run_access(RUN_ID, str(path), peer)
    path.write_text(admission_of(run_key, peer, run_id="other-run").to_text())
    with pytest.raises(MembershipError, match="is for run 'other-run'"):
        load_run_access(RUN_ID, str(path), peer)
    path.write_text(admission_of(run_key, peer).to_text())
    with pytest.raises(MembershipError, match="but this identity is"):
        load_run_access(RUN_ID, str(path), new_peer_id(tmp_path))
    good = admission_of(run_key, peer)
    path.write_text(Admission(RUN_ID, peer, good.run_key, good.signature[:-4] + b"AAA=").to_text())
    with pytest.raises(MembershipError, match="invalid signature"):
        load_run_access(RUN_ID, str(path), peer)
    path.write_text(good.to_text())
    access = load_run_access(RUN_ID, str(path), peer)
    assert access.private and access.admits(peer, good.to_text()) and not access.admits(peer, "")
    assert load_run_access(RUN_ID, str(path), None).run_key == good.run_key  # a reader needs any member's admission


def test_peer_ids_are_checked_before_admitting(tmp_path: Path) -> None:
    check_peer_id(new_peer_id(tmp_path))
    for bad in ("", "Qmnotapeer", "0OIl", "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"):
        with pytest.raises(MembershipError, match="is not a peer id"):
            check_peer_id(bad)


@pytest.mark.swarm
def test_a_private_run_refuses_the_records_and_calls_of_non_members(run_key: Path) -> None:
    """Two members and a non-member that copies a member's admission into its records: the members read only each
    other's records, and their gate admits only each other (and keeps refusing the non-member)."""

    member_ids: list[str] = []

    def access(index: int, peer_id: str) -> RunAccess:
        """Peers 0 and 1 are admitted; peer 2, the stranger, validates nothing of the run's membership."""
        if index == 2:
            return RunAccess(RUN_ID)
        member_ids.append(peer_id)
        admission = admission_of(run_key, peer_id)
        return RunAccess(RUN_ID, admission.run_key, admission.to_text())

    with record_peers(3, access) as peers:
        peers[2].access = peers[0].access  # the stranger's records carry member 0's admission
        for peer in peers:
            peer.publish_membership(wait=True)
            peer.publish_progress(progress(str(peer.dht.peer_id)), wait=True)
        expiration = get_dht_time() + 60
        assert not peers[2].dht.store(f"{RUN_ID}_progress", progress("x").dict(), expiration, subkey=b"plain")
        for reader in peers[:2]:
            wait_until(lambda reader=reader: set(reader.read_progress()) == set(member_ids), 10, "the members' records")
        gate, dht = MemberGate(peers[0].access, members_key(RUN_ID)), peers[0].dht
        for peer_id in member_ids:
            assert asyncio.run(gate.admits(PeerID.from_base58(peer_id), dht))
        stranger = peers[2].dht.peer_id
        assert not asyncio.run(gate.admits(stranger, dht))
        assert asyncio.run(MemberGate.everyone().admits(stranger, dht))


def credential_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip


def test_a_refusal_made_in_one_forked_process_holds_in_all_of_them() -> None:
    """A unit's averagers are processes forked from its main process: a member one of them refuses is refused by the
    main process and by the others (SharedPeerSet), and nobody else is."""
    gate = MemberGate.everyone()
    context = multiprocessing.get_context("fork")
    refusing = context.Process(target=gate.refuse, args=("QmRed",))
    refusing.start()
    refusing.join(timeout=30)
    assert refusing.exitcode == 0
    checking = context.Process(target=_exit_refused, args=(gate, "QmRed"))
    checking.start()
    checking.join(timeout=30)
    assert checking.exitcode == 1 and gate.refused("QmRed") and not gate.refused("QmBlue")


def test_a_suspect_is_refused_only_by_the_view_that_shuns_suspects() -> None:
    gate = MemberGate.everyone()
    shunning = gate.shunning_suspects()
    suspecting = multiprocessing.get_context("fork").Process(target=gate.suspect, args=("QmOdd",))
    suspecting.start()
    suspecting.join(timeout=30)
    assert shunning.refused("QmOdd") and not gate.refused("QmOdd") and not shunning.refused("QmBlue")
    gate.refuse("QmRed")
    assert shunning.refused("QmRed") and gate.refused("QmRed")


def _exit_refused(gate: MemberGate, peer_id: str) -> None:
    sys.exit(1 if gate.refused(peer_id) else 0)


def test_the_credential_commands_make_an_admission_a_member_can_join_with(tmp_path: Path) -> None:
    made = credential_command("run-key", "--out", str(tmp_path / "run.key"))
    assert made.returncode == 0 and "id Qm" in made.stdout, made.stderr
    identity = credential_command("identity", "--identity-path", str(tmp_path / "peer.key"))
    peer_id = identity.stdout.strip()
    assert identity.returncode == 0 and peer_id == identity_peer_id(tmp_path / "peer.key"), identity.stderr
    out = tmp_path / "peer.admission"
    admit = ["admit", "--run-key", str(tmp_path / "run.key"), "--run-id", RUN_ID, "--peer-id", peer_id]
    assert credential_command(*admit, "--out", str(out)).returncode == 0
    assert load_run_access(RUN_ID, str(out), peer_id).private
    assert_user_error(credential_command(*admit[:-1], "Qmnotapeer"), "is not a peer id")
    assert_user_error(credential_command(*admit[:4], "bad/run", *admit[5:]), "--run-id")
    assert_user_error(credential_command("admit", "--run-key", str(out), *admit[3:]), "is not an RSA key file")
    assert_user_error(credential_command("identity", "--identity-path", str(out)), "not a libp2p private key")


@pytest.mark.parametrize("case", ["no-identity", "missing-file", "other-peer"])
def test_joining_with_a_bad_admission_is_refused_cleanly(case: str, run_key: Path, tmp_path: Path) -> None:
    identity = ensure_identity(tmp_path / "peer.key")
    admission = tmp_path / "peer.admission"
    other = new_peer_id(tmp_path) if case == "other-peer" else identity_peer_id(identity)
    if case != "missing-file":
        admission.write_text(admission_of(run_key, other).to_text())
    work = {"work": tmp_path / "work", "save": tmp_path / "save"}
    given = {"--admission": str(admission), "--run-id": RUN_ID}
    if case != "no-identity":
        given["--identity-path"] = str(identity)
    expected = {"no-identity": "--identity-path", "missing-file": "cannot read admission", "other-peer": "admits peer"}
    assert_user_error(join(*flags(work, **given)), expected[case])
    assert not work["work"].exists() or not any(work["work"].iterdir())
