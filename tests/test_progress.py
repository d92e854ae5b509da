"""Progress records: the view of who is live (pure), and signed records through a real DHT on loopback."""

import time

import pytest
from hivemind.utils import ValueWithExpiration, get_dht_time

from helpers import dht_nodes
from peer.net.trust.auth import identity_key
from peer.net.plumbing.addresses import ensure_identity
from peer.net.trust.progress import LiveView, SpeedLedger, make_validators, node_validators, progress_key
from peer.net.trust.records import ProgressRecord

TTL = 10.0
A, B, C, D = (c * 46 for c in "ABCD")  # peer ids of the pure tests (base58 text of a peer id's length)


def rec(pid: str, t: float, step: int = 0) -> dict:
    return ProgressRecord(peer_id=pid, step=step, round=0, tokens_per_second=1.0, client_mode=False,
                          time=t).model_dump()


def found(entries: dict, expiration: float = 1e12) -> ValueWithExpiration:
    """What ``dht.get(key, latest=True)`` returns for a dictionary value: {subkey: (value, expiration)}."""
    return ValueWithExpiration({sub: ValueWithExpiration(v, exp) for sub, (v, exp) in entries.items()}, expiration)


def test_a_peer_stays_live_ttl_after_its_newest_record_arrived_however_old_the_record_was():
    view = LiveView(TTL)
    # written 9 s before it arrived (a DHT stalled on an unreachable node): still live for TTL from arrival
    view.merge(found({b"a": (rec(A, 91.0), 101.0)}), dht_now=100.0, local_now=0.0)
    assert set(view.live(local_now=9.9)) == {A}
    assert view.live(local_now=10.1) == {}
    # the same record again is no news: it does not extend A's life
    view.merge(found({b"a": (rec(A, 91.0), 101.0)}), dht_now=100.0, local_now=5.0)
    assert view.live(local_now=10.1) == {}


def test_a_read_that_misses_or_fails_forgets_no_one():
    view = LiveView(TTL)
    view.merge(found({b"a": (rec(A, 100.0), 110.0), b"b": (rec(B, 100.0), 110.0)}), dht_now=100.0, local_now=0.0)
    view.merge(None, dht_now=103.0, local_now=3.0)  # nothing found
    view.merge(found({b"b": (rec(B, 103.0, step=7), 113.0)}), dht_now=103.0, local_now=3.0)  # A missing
    live = view.live(local_now=9.0)
    assert set(live) == {A, B} and live[B].step == 7
    assert set(view.live(local_now=12.0)) == {B}  # A's last record arrived at 0


def test_newest_record_wins_expired_and_malformed_are_ignored():
    view = LiveView(TTL)
    view.merge(found({b"a": (rec(A, 100.0, step=5), 110.0)}), dht_now=100.0, local_now=0.0)
    view.merge(found({b"a2": (rec(A, 99.0, step=1), 109.0)}), dht_now=100.0, local_now=1.0)  # older: ignored
    assert view.live(local_now=1.0)[A].step == 5
    view.merge(found({b"c": (rec(C, 80.0), 90.0)}), dht_now=100.0, local_now=1.0)  # expired in the DHT
    bad = {**rec(D, 100.0), "step": -1}
    view.merge(found({b"d": (bad, 110.0), b"e": ("not a record", 110.0)}), dht_now=100.0, local_now=1.0)
    assert set(view.live(local_now=1.0)) == {A}


def test_a_withdrawn_record_drops_its_peer_at_once_but_not_a_restarted_one():
    view = LiveView(TTL)
    view.merge(found({b"a": (rec(A, 100.0), 110.0), b"b": (rec(B, 100.0), 110.0)}), dht_now=100.0, local_now=0.0)
    view.merge(found({b"a": (None, 111.0), b"b": (rec(B, 101.0), 111.0)}), dht_now=101.0, local_now=1.0)
    assert set(view.live(local_now=1.0)) == {B}
    # B restarted (same peer id, new signing key): its old key's withdrawal does not drop the new record
    view.merge(found({b"b2": (rec(B, 102.0), 112.0)}), dht_now=102.0, local_now=2.0)
    view.merge(found({b"b": (None, 112.0), b"b2": (rec(B, 102.0), 112.0)}), dht_now=102.0, local_now=2.0)
    assert set(view.live(local_now=2.0)) == {B}


@pytest.mark.timeout(120)
def test_a_speed_is_vouched_for_after_a_window_of_records_and_is_their_lowest_claim():
    """The robust rule's caps (aggregate.vouched_caps) trust a claimed speed only once the peer has claimed it
    for a whole window, and only its lowest claim in it: a newcomer or one fast record buys nothing."""
    def claim(pid: str, tps: float) -> ProgressRecord:
        return ProgressRecord(peer_id=pid, step=0, round=0, tokens_per_second=tps, client_mode=False, time=0.0)

    ledger = SpeedLedger(window=60.0)
    for t in range(0, 61, 5):  # A claims 100 tokens/s steadily, with one spike; B arrives at t = 30
        a = claim(A, 1000.0 if t == 40 else 100.0)
        ledger.observe({A: a} if t < 30 else {A: a, B: claim(B, 500.0)}, float(t))
        if t < 60:
            assert ledger.vouched(A, float(t)) is None
    assert ledger.vouched(A, 60.0) == 100.0  # the spike does not count
    assert ledger.vouched(B, 60.0) is None  # heard from for 30 s only
    ledger.observe({B: claim(B, 500.0)}, 65.0)  # A is gone: forgotten, a newcomer when it comes back
    assert ledger.vouched(A, 65.0) is None
    ledger.observe({A: claim(A, 100.0), B: claim(B, 500.0)}, 100.0)
    assert ledger.vouched(A, 100.0) is None and ledger.vouched(B, 100.0) == 500.0


def identity_signers(run_key: str, tmp_path, n: int) -> list[tuple[list, bytes]]:
    """Each node's validators and record subkey, signed with its identity key (dht_nodes' n{i}.id)."""
    return [make_validators(run_key, identity_key(tmp_path / f"n{i}.id")) for i in range(n)
            if ensure_identity(tmp_path / f"n{i}.id")]


def test_signed_records_through_a_real_dht(tmp_path):
    """Two DHT nodes on loopback and a bootstrap-like third (no run key): each peer stores its record, both read
    both; a forged record (another peer's key, a record naming another peer's id, or not a ProgressRecord) is
    refused by every node; a withdrawal drops the peer from the other's view."""
    run_key = "testrun_progress"
    key = progress_key(run_key)
    signers = identity_signers(run_key, tmp_path, 2)
    subkeys = [subkey for _, subkey in signers]
    with dht_nodes(3, tmp_path, validators=lambda i: signers[i][0] if i < 2 else node_validators()) as nodes:
        pids = [str(n.peer_id) for n in nodes]
        for node, subkey, pid in zip(nodes, subkeys, pids):
            assert node.store(key, rec(pid, get_dht_time()), get_dht_time() + 30, subkey=subkey)
        # another peer's subkey (signature check) and a value that is not a record (schema check)
        assert not nodes[1].store(key, rec(pids[1], get_dht_time()), get_dht_time() + 30, subkey=subkeys[0])
        assert not nodes[1].store(key, {"peer_id": pids[1]}, get_dht_time() + 30, subkey=subkeys[1])
        # shadowing (issue 28): a record signed by node 1 that speaks for node 0 (every node refuses it)
        assert not nodes[1].store(key, rec(pids[0], get_dht_time(), step=10**9), get_dht_time() + 30,
                                  subkey=subkeys[1])
        # schema-valid and validly signed, but its peer id is not one and its rounds overflow: issue 13's
        # record that made every honest peer exit (the catch-up picked it, parsing the donor id raised)
        hostile = {**rec("not-a-peer-id", get_dht_time()), "rounds": [1 << 63], "digests": ["ab"]}
        assert not nodes[1].store(key, hostile, get_dht_time() + 30, subkey=subkeys[1])
        assert not nodes[1].store(key, {**rec(pids[1], get_dht_time()), "digests": ["<script>"], "rounds": [1]},
                                  get_dht_time() + 30, subkey=subkeys[1])
        views = [LiveView(30.0) for _ in nodes]
        for node, view in zip(nodes, views):  # (the third node reads what the peers stored, unforged)
            view.merge(node.get(key, latest=True), dht_now=get_dht_time(), local_now=time.monotonic())
            assert set(view.live(time.monotonic())) == set(pids[:2])
            assert all(r.step == 0 for r in view.live(time.monotonic()).values())  # (no forged step)
        assert nodes[0].store(key, None, get_dht_time() + 30, subkey=subkeys[0])  # peer 0 leaves
        views[1].merge(nodes[1].get(key, latest=True), dht_now=get_dht_time(), local_now=time.monotonic())
        assert set(views[1].live(time.monotonic())) == {pids[1]}


def test_a_record_speaks_only_for_its_signers_peer_id_on_peers_and_bootstrap_nodes(tmp_path):
    """Self-certifying records: validly signed records that name another peer's id (shadowing) are refused by a
    peer's validators and by a bootstrap node's (no run key: it holds every record that names a peer_id to the
    rule, whatever its key); the signer's own record passes both; records that name no peer id are not the
    bootstrap node's business."""
    import dataclasses

    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import CompositeValidator, DHTRecord

    run_key = "testrun_certify"
    (validators, subkey), (_, other_subkey) = identity_signers(run_key, tmp_path, 2)
    mine, other = (ensure_identity(tmp_path / f"n{i}.id") for i in range(2))
    signer = validators[1]  # (hivemind's RSASignatureValidator with our identity key)
    dumps = DHTProtocol.serializer.dumps

    def signed(key: str, value, sub: bytes = subkey) -> DHTRecord:
        record = DHTRecord(DHTID.generate(source=key).to_bytes(), dumps(sub), dumps(value), get_dht_time() + 30)
        return dataclasses.replace(record, value=signer.sign_value(record))

    def passes(record: DHTRecord, checks) -> bool:  # (as the DHT applies them: the signature is stripped first)
        return CompositeValidator(checks).validate(record)

    for checks in (validators, node_validators()):
        assert passes(signed(progress_key(run_key), rec(mine, 1.0)), checks)
        assert not passes(signed(progress_key(run_key), rec(other, 1.0)), checks)  # shadowing
        assert not passes(signed(progress_key(run_key), rec(mine, 1.0), other_subkey), checks)  # not our key
    assert passes(signed("another run_progress", rec(mine, 1.0)), node_validators())
    assert not passes(signed("another run_progress", rec(other, 1.0)), node_validators())
    assert passes(signed("some other key", [1, 2, 3]), node_validators())


@pytest.mark.timeout(120)
def test_a_swarm_that_shuts_down_withdraws_its_record_and_the_others_drop_it_at_once(tmp_path):
    """Two real swarms on loopback (progress records every 0.5 s, a TTL of 60 s): once each sees the other, one
    shuts down; the other drops it within a few heartbeats, not a TTL later (its rounds stop waiting for it)."""
    from helpers import wait_for
    from peer.config import SwarmConfig
    from peer.net.swarm import Swarm

    def config(**kw) -> SwarmConfig:
        return SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], progress_period=0.5, progress_ttl=60.0,
                           reachability_check=False, **kw)

    ids = {n: str(tmp_path / f"{n}.id") for n in "ab" if ensure_identity(tmp_path / f"{n}.id")}
    first = Swarm(config(new_swarm=True), run_key="t", codec="fp32", identity_path=ids["a"])
    first.start()
    second = None
    try:
        second = Swarm(config(initial_peers=first.visible_maddrs()), run_key="t", codec="fp32",
                       identity_path=ids["b"])
        second.start()
        for s in (first, second):
            s.ours.update_progress(10, 1, 1.0)
        wait_for(lambda: second.peer_id in first.live_peers() and first.peer_id in second.live_peers(), 30,
                 "each swarm to see the other")
        gone, t0 = second.peer_id, time.monotonic()
        second.shutdown()
        wait_for(lambda: gone not in first.live_peers(), 15, "the first swarm to drop the one that left")
        assert time.monotonic() - t0 < 15 < first.cfg.progress_ttl
    finally:
        if second is not None:
            second.shutdown()
        first.shutdown()
