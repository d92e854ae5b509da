"""Authenticated runs (peer/net/trust/auth.py, bootstrap/authority.py): passes, records bound to them, revocation,
and a real swarm in which a peer without a pass is refused at every entry point while admitted peers train
with identical digests."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from helpers import Proc, events, in_process, run_async, wait_for
from peer.net.trust.auth import (Admission, PassChecker, RunAccess, decode_pass, encode_pass, identity_key,
                                 issue_pass, owner_key, parse_pass_request, pass_request, peer_id_of, record_admitted)
from peer.net.trust.revocations import RevocationValidator, revocation_key, sign_revocations, verify_revocations
from peer.net.plumbing.addresses import ensure_identity
from peer.net.trust.records import ProgressRecord
from test_swarm import REPO, start_peer, wait_exit

AUTHORITY, STRANGER = RSAPrivateKey(), RSAPrivateKey()
PUB = AUTHORITY.get_public_key().to_bytes()


def subkey_of(key: RSAPrivateKey) -> bytes:
    return b"[owner:" + key.get_public_key().to_bytes() + b"]"


def record(peer_id: str, pass_line: str) -> ProgressRecord:
    return ProgressRecord(peer_id=peer_id, step=1, round=0, tokens_per_second=1.0, client_mode=False, time=0.0,
                          pass_line=pass_line)


def test_a_pass_names_one_peer_and_only_the_authority_can_make_one(tmp_path):
    peer_id = ensure_identity(tmp_path / "id")
    peer = identity_key(tmp_path / "id")
    assert peer_id_of(peer.get_public_key()) == peer_id  # the pass's key is the transport's identity
    checker = PassChecker(PUB)
    token = issue_pass(AUTHORITY, peer.get_public_key(), timedelta(days=1))
    assert checker.valid(token) and token.username == peer_id
    assert decode_pass(encode_pass(token)) == token
    # a request line round-trips to the key, and names its peer id
    assert parse_pass_request(pass_request(peer)).to_bytes() == peer.get_public_key().to_bytes()
    forged = pass_request(peer).replace("Qm", "Qn", 1)
    with pytest.raises(ValueError):
        parse_pass_request(forged)
    # tampering with any field, another authority, expiry, revocation: refused, each with its reason
    other = RSAPrivateKey()
    cases = {
        "another key": dict(public_key=other.get_public_key().to_bytes()),
        "another peer id": dict(username=peer_id_of(other.get_public_key())),
        "a later expiry": dict(expiration_time=(datetime.now(timezone.utc) + timedelta(days=999)).isoformat()),
        "a malformed expiry": dict(expiration_time="tomorrow"),
    }
    for what, change in cases.items():
        bad = type(token)()
        bad.CopyFrom(token)
        for k, v in change.items():
            setattr(bad, k, v)
        assert not checker.valid(bad), what
    assert checker.why_invalid(issue_pass(STRANGER, peer.get_public_key(), timedelta(days=1))) == \
        "it is not signed by this run's authority"
    assert "expired" in checker.why_invalid(issue_pass(AUTHORITY, peer.get_public_key(), timedelta(seconds=-1)))
    assert PassChecker(PUB, revoked=[token.username]).why_invalid(token) == "the authority revoked it"
    # hostile lines are refused before decoding anything big
    for line in ["", "swarmloco-pass:!!!", "swarmloco-pass:" + "A" * 10_000, "hello"]:
        with pytest.raises(ValueError):
            decode_pass(line)


def test_a_record_counts_only_with_its_owners_pass():
    """A progress record must carry a valid pass naming its peer id and the key that signed it: a record
    without one, or with a pass copied from another peer, is refused by the DHT validator and by the view."""
    alice, mallory = RSAPrivateKey(), RSAPrivateKey()
    checker = PassChecker(PUB)
    alice_id = peer_id_of(alice.get_public_key())
    alice_pass = encode_pass(issue_pass(AUTHORITY, alice.get_public_key(), timedelta(days=1)))
    assert record_admitted(checker, subkey_of(alice), alice_pass, alice_id)
    assert not record_admitted(checker, subkey_of(alice), "", alice_id)
    assert not record_admitted(checker, subkey_of(mallory), alice_pass, alice_id)  # a copied pass: wrong signer
    assert not record_admitted(checker, subkey_of(mallory), alice_pass, peer_id_of(mallory.get_public_key()))
    assert owner_key(subkey_of(alice)) == alice.get_public_key().to_bytes()
    admission = Admission(checker)
    assert not admission.admitted(alice_id)
    assert not admission.accept_record(subkey_of(mallory), record(alice_id, alice_pass))
    assert admission.accept_record(subkey_of(alice), record(alice_id, alice_pass))
    assert admission.admitted(alice_id)
    assert admission.revoke([alice_id]) == {alice_id} and not admission.admitted(alice_id)
    assert not admission.accept_record(subkey_of(alice), record(alice_id, alice_pass))
    assert Admission(None).admitted("anyone") and Admission(None).accept_record(b"", record(alice_id, ""))


def test_revocation_lists_are_the_authoritys_or_nothing():
    checker = PassChecker(PUB)
    ids = [peer_id_of(RSAPrivateKey().get_public_key()) for _ in range(2)]
    value = sign_revocations(AUTHORITY, ids, issued=time.time())
    assert verify_revocations(checker, value) == frozenset(ids)
    assert verify_revocations(checker, sign_revocations(STRANGER, ids, issued=time.time())) is None
    assert verify_revocations(checker, {**value, "revoked": ids[:1]}) is None  # tampered
    for junk in [None, [], {"revoked": "x"}, {**value, "revoked": ["not a peer id"]}, {**value, "issued": "now"}]:
        assert verify_revocations(checker, junk) is None
    assert revocation_key(PUB) != revocation_key(STRANGER.get_public_key().to_bytes())
    assert isinstance(RevocationValidator(checker), RevocationValidator)


def test_run_access_says_in_one_line_what_to_fix(tmp_path):
    ensure_identity(tmp_path / "id")
    me = identity_key(tmp_path / "id")
    authority = PUB.decode()
    with pytest.raises(ValueError, match="swarm.pass_path: .*cannot be read.*pass-request"):
        RunAccess.load(authority, tmp_path / "missing.txt", tmp_path / "id")
    with pytest.raises(ValueError, match="swarm.authority"):
        RunAccess.load("ssh-rsa garbage", tmp_path / "missing.txt", tmp_path / "id")
    (tmp_path / "other.txt").write_text(encode_pass(issue_pass(AUTHORITY, RSAPrivateKey().get_public_key(),
                                                               timedelta(days=1))))
    with pytest.raises(ValueError, match="is for peer .*, this peer is"):
        RunAccess.load(authority, tmp_path / "other.txt", tmp_path / "id")
    (tmp_path / "stranger.txt").write_text(encode_pass(issue_pass(STRANGER, me.get_public_key(), timedelta(days=1))))
    with pytest.raises(ValueError, match="not signed by this run's authority"):
        RunAccess.load(authority, tmp_path / "stranger.txt", tmp_path / "id")
    (tmp_path / "pass.txt").write_text(encode_pass(issue_pass(AUTHORITY, me.get_public_key(), timedelta(days=1))))
    access = RunAccess.load(authority, tmp_path / "pass.txt", tmp_path / "id")
    assert access.token.username == ensure_identity(tmp_path / "id")


def cli(program: str, *args: str) -> subprocess.CompletedProcess:
    """``swarm-bootstrap ...`` or ``swarm-peer ...``, in this process (their main functions; fast)."""
    from bootstrap.cli import main as bootstrap_main
    from peer.cli.swarm_peer import main as peer_main

    return in_process({"bootstrap": bootstrap_main, "peer": peer_main}[program], *args)


def test_authority_commands_print_what_to_paste_and_refuse_bad_input(tmp_path):
    ca = tmp_path / "ca"
    out = cli("bootstrap", "authority", "init", str(ca))
    assert out.returncode == 0 and out.stdout.startswith('[swarm]\nauthority = "ssh-rsa ')
    assert (ca / "authority.key").stat().st_mode & 0o077 == 0
    again = cli("bootstrap", "authority", "init", str(ca))
    assert again.returncode == 2 and "already there" in again.stderr and len(again.stderr.splitlines()) == 1
    request = cli("peer", "pass-request", "--run-dir", str(tmp_path / "v")).stdout.strip()
    issued = cli("bootstrap", "authority", "issue", str(ca), request, "--days", "2")
    assert issued.returncode == 0 and issued.stdout.startswith("swarmloco-pass:")
    assert PassChecker((ca / "authority.pub").read_text()).valid(decode_pass(issued.stdout))
    for bad in [("issue", str(ca), "nonsense"), ("issue", str(ca), request, "--days", "-1"),
                ("issue", str(tmp_path / "nowhere"), request), ("revoke", str(ca), "not-a-peer-id")]:
        refused = cli("bootstrap", "authority", *bad)
        assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, (bad, refused.stderr)
    peer_id = decode_pass(issued.stdout).username
    assert cli("bootstrap", "authority", "revoke", str(ca), peer_id).returncode == 0
    assert (ca / "revoked.txt").read_text().split() == [peer_id]


def _hostile_calls(peer_maddrs: list[str], peer_id: str, bootstrap: list[str]) -> dict[str, str]:
    """What a client without a pass gets from an admitted peer's handlers and from the run's DHT."""
    from hivemind.p2p import P2P, PeerID

    from peer.net.round.reducer import AllReduceServicer
    from peer.net.plumbing.dht import JoinError, create_dht
    from peer.net.state_transfer import StateServicer
    from peer.proto import allreduce_pb2, state_pb2

    async def streams() -> dict[str, str]:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, initial_peers=peer_maddrs)
        try:
            target = PeerID.from_base58(peer_id)
            got = {}
            calls = {"rpc_reduce": (AllReduceServicer, allreduce_pb2.ReduceRequest(
                         group_id=b"g" * 16, span_index=0, weight=1.0), allreduce_pb2.ReduceResponse),
                     "rpc_download": (StateServicer, state_pb2.StateRequest(fragment=0, round=1),
                                      state_pb2.StateChunk)}
            for name, (servicer, request, reply) in calls.items():
                for _ in range(3):  # (a stream may end with no message at all where our new connection to the
                    try:            # peer closes under it; the refusal comes on the next one)
                        stream = await p2p.iterate_protobuf_handler(
                            target, servicer._get_handle_name(None, name), request, reply)
                        errors = [r.error async for r in stream]
                        got[name] = errors[0] if errors else "closed without a reply"
                    except (ConnectionResetError, BrokenPipeError):  # the refusal and the close overtook our request
                        got[name] = "reset"
                    if got[name] != "closed without a reply":
                        break
            return got
        finally:
            await p2p.shutdown()

    got = run_async(asyncio.wait_for(streams(), 60))
    try:
        dht = create_dht(initial_peers=bootstrap, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                         identity_path=None, client_mode=False, wait_timeout=3.0, join_timeout=0.0)
        dht.shutdown()
        got["dht"] = "joined"
    except (JoinError, RuntimeError) as e:
        got["dht"] = str(e)
    return got


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_an_authenticated_run_admits_only_peers_with_a_pass(procs, tmp_path):
    """The operator's authority admits p0 and p1. A peer whose pass comes from another authority is stopped
    before joining; a client without a pass is refused by the peers' reduce and download handlers and cannot
    join the DHT (the join handler's refusal: tests/test_wire_fuzz.py); p0 and p1 average with identical
    digests. Then the operator revokes p1: p1 stops with a clear line, p0 works alone."""
    ca, other = tmp_path / "ca", tmp_path / "other"
    assert cli("bootstrap", "authority", "init", str(ca)).returncode == 0
    assert cli("bootstrap", "authority", "init", str(other)).returncode == 0
    authority = (ca / "authority.pub").read_text().strip()
    for name, issuer in [("p0", ca), ("p1", ca), ("intruder", other)]:
        request = cli("peer", "pass-request", "--run-dir", str(tmp_path / name)).stdout.strip()
        issued = cli("bootstrap", "authority", "issue", str(issuer), request, "--days", "1")
        (tmp_path / name / "pass.txt").write_text(issued.stdout)
    boot = Proc.start([sys.executable, "-m", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path",
                       str(tmp_path / "boot.id"), "--authority", str(ca), "--refresh-period", "2"],
                      log_path=tmp_path / "boot.log", cwd=REPO)
    procs.append(boot)
    initial = boot.wait_for_line(r"^--initial-peers (.+)$", timeout=60).group(1).split()
    auth = ["--authority", authority, "--min-peers", "2"]

    intruder = start_peer(procs, tmp_path, "intruder", initial, 40, *auth)
    assert wait_exit(intruder, 120) == 2
    assert "swarm.pass_path" in intruder.tail() and "not signed by this run's authority" in intruder.tail()

    peers = {name: start_peer(procs, tmp_path, name, initial, 200, *auth) for name in ("p0", "p1")}
    ids = {n: wait_for(lambda n=n: events(tmp_path, n, "start"), 120, f"{n} started")[0]["peer_id"] for n in peers}
    start = events(tmp_path, "p0", "start")[0]
    hostile = _hostile_calls(start["maddrs"], ids["p0"], initial)
    for name in ("rpc_reduce", "rpc_download"):
        assert "valid pass" in hostile[name] or hostile[name] == "reset", hostile
    # a reset is a refusal only if p0 says so: its guard logs the first stream it refused for want of a pass
    wait_for(lambda: any("it holds no valid pass for this run" in line for line in peers["p0"].lines()), 10,
             "p0's refusal line")
    assert hostile["dht"] != "joined", hostile

    def together() -> list:
        rounds = {n: {(e["fragment"], e["round"]): e for e in events(tmp_path, n, "round") if e["status"] == "ok"}
                  for n in peers}
        return [k for k in set(rounds["p0"]) & set(rounds["p1"])
                if rounds["p0"][k]["digest"] == rounds["p1"][k]["digest"] and rounds["p0"][k]["group_size"] == 2]

    wait_for(lambda: len(together()) >= 2, 240, "two rounds averaged by p0 and p1 with one digest")
    assert any("refused a stream from" in line and "valid pass" in line for line in peers["p0"].lines())

    t_revoke = time.time()
    assert cli("bootstrap", "authority", "revoke", str(ca), ids["p1"]).returncode == 0
    assert wait_exit(peers["p1"], 120) == 2
    assert "revoked this peer's pass" in peers["p1"].tail()
    peers["p0"].wait_for_line(re.escape(f"revoked peer {ids['p1'][-8:]}'s pass"), timeout=60)
    assert wait_exit(peers["p0"], 300) == 0, peers["p0"].tail()
    # once p0 has launched a round without p1 (alone: it no longer counts p1), no later round includes it
    alone = [e for e in events(tmp_path, "p0", "round") if e["status"] == "alone" and e["time"] > t_revoke]
    assert alone, "p0 never launched a round after p1 was revoked"
    assert not [e for e in events(tmp_path, "p0", "round") if e["time"] > alone[0]["time"] and e["group_size"] > 1]


@pytest.mark.timeout(120)
def test_a_revocation_reaches_the_dht_process_which_then_refuses_the_revoked_peers_requests(tmp_path):
    """The DHT process checks every DHT request with the checker it forked with; the revocations a peer reads
    are applied there too (revocations.revoke_in_dht), so a revoked pass stops working at once, not at its expiry."""
    from functools import partial

    from hivemind.utils import get_dht_time

    from peer.net.plumbing import dht as dht_node
    from peer.net.trust.auth import RunAuthorizer
    from peer.net.trust.revocations import revoke_in_dht

    def node(name: str, initial: list[str]):
        ensure_identity(str(tmp_path / f"{name}.id"))
        key = identity_key(tmp_path / f"{name}.id")
        token = issue_pass(AUTHORITY, key.get_public_key(), timedelta(hours=1))
        checker = PassChecker(PUB)
        return token.username, dht_node.create_dht(
            initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
            identity_path=str(tmp_path / f"{name}.id"), client_mode=False,
            record_validators=[RevocationValidator(checker)], authorizer=RunAuthorizer(key, token, checker),
            startup_timeout=30, wait_timeout=3.0)

    nodes = []
    try:
        _, a = node("a", [])
        nodes.append(a)
        b_id, b = node("b", dht_node.visible_maddrs(a))
        nodes.append(b)
        b.store("before", 1, get_dht_time() + 60)
        assert a.get("before", latest=True).value == 1  # b holds a valid pass: a takes its store and answers
        assert a.run_coroutine(partial(revoke_in_dht, frozenset({b_id}))) == 1  # (one checker, shared)
        b.store("after", 2, get_dht_time() + 60)  # (b keeps its own copy)
        assert a.get("after", latest=True) is None  # a's DHT process refuses b's requests and answers now
    finally:
        for n in nodes:
            dht_node.shutdown_dht(n)
