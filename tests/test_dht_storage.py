"""What a DHT node keeps for others is bounded (peer/net/plumbing/dht_storage.py): the storage alone, and a real
node."""

import contextlib
import time

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from helpers import dht_nodes
from peer.net.plumbing import dht_storage
from peer.net.plumbing.dht_storage import BOUNDS, STORER, BoundedStorage, SizeGate, StorageBounds
from peer.net.trust.records import MAX_FRAGMENTS, MAX_PASS_CHARS, MAX_PAST, ProgressRecord

SMALL = StorageBounds(max_value_bytes=1000, max_horizon=60.0, max_keys=4, max_subkeys=3, max_key_bytes=5000,
                      max_bytes=5000)


def key(i: int) -> DHTID:
    return DHTID.generate(source=f"k{i}")


def test_each_bound_refuses_a_store_and_evicts_nothing():
    s = BoundedStorage(bounds=SMALL)
    soon = get_dht_time() + 30
    assert not s.store(key(0), b"x" * 1001, soon)  # value too large
    assert not s.store(key(0), b"x", get_dht_time() + 61)  # expires past the horizon
    assert not s.store(key(0), b"x", float("nan"))
    for i in range(4):
        assert s.store(key(i), b"x" * 10, soon)
    assert not s.store(key(4), b"x", soon)  # a fifth key
    assert s.store(key(0), b"y" * 10, soon + 1)  # a key held can be replaced
    for sub in (b"a", b"b", b"c"):
        assert s.store(key(5 - 2), b"z", soon + 2, subkey=sub)  # (key 3 turns into a dictionary)
    assert not s.store(key(3), b"z", soon + 2, subkey=b"d")  # a fourth subkey
    assert s.store(key(3), b"zz", soon + 3, subkey=b"a")  # a subkey held can be replaced
    assert [s.get(key(i)) is not None for i in range(4)] == [True] * 4  # nothing was pushed out


def test_the_byte_budget_counts_what_is_held_and_frees_what_expires():
    s = BoundedStorage(bounds=StorageBounds(max_value_bytes=1000, max_horizon=60.0, max_keys=10, max_subkeys=3,
                                            max_key_bytes=5000, max_bytes=5000))
    now = get_dht_time()
    for i, expires in enumerate([30, 30, 0.5, 30]):
        assert s.store(key(i), b"x" * 1000, now + expires)
    assert s.used() == 4 * (1000 + 64)
    assert not s.store(key(4), b"x" * 1000, now + 30)  # a fifth does not fit ...
    assert not s.store(key(4), b"x" * 800, now + 30, subkey=b"s")
    assert s.store(key(1), b"y" * 1000, now + 31)  # ... a value held can be replaced by one as large ...
    assert s.store(key(4), b"x" * 100, now + 30)  # ... and what is left is there to take
    deadline = time.monotonic() + 5
    while s.get(key(2)) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.get(key(2)) is None and s.used() == 3 * (1000 + 64) + 164  # an expired value frees its bytes
    assert s.store(key(5), b"x" * 1000, now + 30)


def test_a_key_holds_no_more_than_one_answer_carries():
    """The storage alone: a key stops taking new subkeys at ``max_key_bytes``; others still do."""
    bounds = StorageBounds(max_value_bytes=1000, max_horizon=60.0, max_keys=10, max_subkeys=100,
                           max_key_bytes=3 * (1000 + 2 + 64), max_bytes=100_000)
    s = BoundedStorage(bounds=bounds)
    soon = get_dht_time() + 30
    for sub in (b"s0", b"s1", b"s2"):
        assert s.store(key(0), b"x" * 1000, soon, subkey=sub)
    assert not s.store(key(0), b"x", soon, subkey=b"s3")  # a fourth would pass the key's bytes
    assert s.store(key(0), b"y" * 1000, soon + 1, subkey=b"s1")  # one held can be replaced by one as large
    assert not s.store(key(0), b"y" * 1001, soon + 1, subkey=b"s1")  # ... not by a larger one
    assert s.store(key(1), b"x" * 1000, soon, subkey=b"s3")  # another key is not affected
    assert len(s.get(key(0)).value) == 3  # (nothing pushed out)


def test_a_reader_over_the_network_gets_a_key_filled_to_its_bound(tmp_path):
    """A DHT node answers a find with the key's whole value in one message, which p2pd carries up to 4 MiB: 90
    records of 50 KB under one key (4.5 MB; sybils of a flood, each record valid) made every reader that does not
    hold the key itself get nothing. Now the node keeps what fits, and a client-mode reader gets all of it."""
    with dht_nodes(2, tmp_path, client=lambda i: i == 1) as (node, reader):
        expires = get_dht_time() + 60
        kept = sum(bool(node.store("progress", b"x" * 50_000, expires, subkey=f"sybil{i}".encode()))
                   for i in range(90))
        assert 0 < kept < 90 and kept * (50_000 + 64) <= BOUNDS.max_key_bytes
        got = reader.get("progress", latest=True)
        assert got is not None and len(got.value) == kept


def test_the_largest_valid_progress_record_fits_a_value():
    """A record of a run of MAX_FRAGMENTS fragments, every list full, with a pass: signed, it is still a value
    every node keeps."""
    digest = "f" * 32
    rec = ProgressRecord(peer_id="Q" * 46, step=1 << 40, round=1 << 40, rounds=[1 << 40] * MAX_FRAGMENTS,
                         digests=[digest] * MAX_FRAGMENTS, past=[(1 << 40, 1 << 40, digest)] * MAX_PAST,
                         seeking=[[1 << 40, 1 << 40]] * 64, averaging=[[1 << 40, 1 << 40]] * 64,
                         tokens_per_second=1e300, pass_line="p" * MAX_PASS_CHARS, client_mode=False, loss=1e6,
                         version="v" * 32, upload_bytes_per_second=1e300, time=1e300)
    signed = len(DHTProtocol.serializer.dumps(rec.model_dump())) + 1024  # (hivemind's [signature:...] suffix)
    assert signed <= BOUNDS.max_value_bytes, signed


def test_an_oversized_value_is_refused_before_any_other_validator_reads_it():
    """The size gate runs first whatever order the validators were given in: a value one byte over the bound
    never reaches the others (each reads every byte: a flood of large records would cost their time); one at
    the bound does."""

    class Reader(RecordValidatorBase):
        def __init__(self, priority: int):
            self.read, self._priority = [], priority

        def validate(self, record: DHTRecord) -> bool:
            self.read.append(len(record.value))
            return True

        @property
        def priority(self) -> int:
            return self._priority

    readers = [Reader(10), Reader(-10)]
    chain = CompositeValidator([readers[0], SizeGate(), readers[1]])
    record = lambda n: DHTRecord(key=b"k", subkey=b"s", value=b"x" * n, expiration_time=1.0)  # noqa: E731
    assert not chain.validate(record(BOUNDS.max_value_bytes + 1))
    assert all(r.read == [] for r in readers)
    assert chain.validate(record(BOUNDS.max_value_bytes))
    assert all(r.read == [BOUNDS.max_value_bytes] for r in readers)


def test_a_real_node_keeps_no_value_past_its_bounds(tmp_path):
    """Through two DHT processes on loopback: a value of max_value_bytes + 1 and one that expires in two hours
    are refused by both nodes; a normal one is kept."""
    with dht_nodes(2, tmp_path) as (a, b):
        assert not a.store("big", b"x" * (BOUNDS.max_value_bytes + 1), get_dht_time() + 30)
        assert not a.store("forever", b"x", get_dht_time() + 2 * BOUNDS.max_horizon)
        assert a.store("fine", b"x" * 1000, get_dht_time() + 30)
        for node in (a, b):
            assert node.get("big") is None and node.get("forever") is None
            assert node.get("fine").value == b"x" * 1000


QUOTA = StorageBounds(max_value_bytes=1000, max_horizon=60.0, max_keys=100, max_subkeys=100, max_key_bytes=100_000,
                      max_bytes=100_000, max_peer_bytes=3 * (1000 + 64), max_host_bytes=5 * (1000 + 64))


@contextlib.contextmanager
def storing_for(peer: str, host=None):
    token = STORER.set((peer, host))
    try:
        yield
    finally:
        STORER.reset(token)


def test_another_node_holds_no_more_than_its_share_and_its_host_no_more_than_its_own():
    """One node's stores stop at max_peer_bytes (new keys, new subkeys); replacing what it holds still works; other
    nodes, and our own stores, are not held back. The nodes of one host stop together at max_host_bytes; loopback
    and relayed nodes (host None) count one by one."""
    s, soon = BoundedStorage(bounds=QUOTA), get_dht_time() + 30
    with storing_for("sybil1", "10.0.0.9"):
        assert [s.store(key(i), b"x" * 1000, soon) for i in range(4)] == [True, True, True, False]
        assert not s.store(key(9), b"x" * 10, soon, subkey=b"more")
        assert s.store(key(0), b"y" * 1000, soon + 1)  # its own entry replaced: no more held than before
        assert s.held_for("sybil1") == 3 * (1000 + 64)
    with storing_for("sybil2", "10.0.0.9"):
        assert [s.store(key(10 + i), b"x" * 1000, soon) for i in range(3)] == [True, True, False]  # the host's 5
    with storing_for("honest", "10.0.0.1"):
        assert s.store(key(20), b"x" * 1000, soon)
    with storing_for("loopback1", None), storing_for("loopback2", None):  # (the inner one stores)
        assert [s.store(key(30 + i), b"x" * 1000, soon) for i in range(4)] == [True, True, True, False]
    with storing_for("loopback1", None):
        assert s.store(key(40), b"x" * 1000, soon)
    assert all(s.store(key(50 + i), b"x" * 1000, soon) for i in range(10))  # our own: only the node's bounds


def test_what_another_node_stored_frees_its_share_once_gone(monkeypatch):
    """Entries that expired, or that we replaced with our own, stop counting against the node that stored them
    (at the next recount: once per PRUNE_PERIOD, here every time)."""
    monkeypatch.setattr(dht_storage, "PRUNE_PERIOD", 0.0)
    s, now = BoundedStorage(bounds=QUOTA), get_dht_time()
    with storing_for("peer", "10.0.0.9"):
        assert s.store(key(0), b"x" * 1000, now + 0.3)
        assert s.store(key(1), b"x" * 999, now + 30, subkey=b"a")  # (an entry of 999 + 1 + 64 bytes)
        assert s.store(key(2), b"x" * 1000, now + 30)
        assert not s.store(key(3), b"x" * 1000, now + 30)
    assert s.store(key(2), b"ours", now + 31)  # we replaced its value: no longer its
    deadline = time.monotonic() + 5
    while s.get(key(0)) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    with storing_for("peer", "10.0.0.9"):
        assert s.store(key(3), b"x" * 1000, now + 30) and s.store(key(4), b"x" * 1000, now + 30)
        assert not s.store(key(5), b"x" * 1000, now + 30)
        assert s.held_for("peer") == 3 * (1000 + 64)


async def _entries_held(_dht, node) -> int:
    return len(node.protocol.storage.data)


def test_a_real_node_keeps_for_another_no_more_than_its_share(tmp_path):
    """Through two DHT processes on loopback: the storer's node keeps all 30 of its values of 50 KB, the other node
    (which is told who asks) only what fits the storer's share."""
    with dht_nodes(2, tmp_path) as (a, b):
        expires = get_dht_time() + 60
        for i in range(30):  # (True where every node that was asked kept it)
            a.store(f"flood{i}", b"x" * 50_000, expires)
        held = [node.run_coroutine(_entries_held) for node in (a, b)]
        assert held[0] >= 30
        assert 0 < held[1] <= BOUNDS.max_peer_bytes // (50_000 + 64), held
        assert b.store("honest", b"x" * 50_000, expires)  # b's own store, and room for others: untouched
