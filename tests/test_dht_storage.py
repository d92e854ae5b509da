"""What a DHT node keeps for others is bounded (peer/net/plumbing/dht_storage.py): the storage alone, and a real
node."""

import contextlib
import time
from collections import Counter

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time, timed_storage
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_a_full_key_makes_room_for_a_host_that_holds_less_of_it_than_the_largest():
    """Two hosts fill a key (bytes, then subkeys); a third host's entry still goes in, in place of the largest entry
    of the host that holds the most of it, and so does ours. A host that holds no less than any other cannot push
    anyone out, so the flooding hosts cannot push out each other's entries at equal shares, nor ever the smaller
    ones'."""
    entry = 1000 + 2 + 64  # (a value of 1000 bytes at a 2-byte subkey)
    bounds = StorageBounds(max_value_bytes=1000, max_horizon=60.0, max_keys=10, max_subkeys=8,
                           max_key_bytes=6 * entry, max_bytes=100_000, max_host_key_share=1.0)  # (the rule alone)
    s, soon = BoundedStorage(bounds=bounds), get_dht_time() + 30
    for host in ("10.0.0.8", "10.0.0.9"):
        with storing_for(f"sybil{host[-1]}", host):
            assert all(s.store(key(0), b"x" * 1000, soon, subkey=f"{host[-1]}{i}".encode()) for i in range(3))
    with storing_for("sybil8", "10.0.0.8"):  # (shares 3 and 3: nobody holds more than it would)
        assert not s.store(key(0), b"x" * 1000, soon, subkey=b"83")
    with storing_for("honest", "10.0.0.1"):
        assert s.store(key(0), b"h" * 1000, soon, subkey=b"h0")
        assert s.store(key(0), b"H" * 1000, soon + 1, subkey=b"h0")  # its own refreshed: nothing more dropped
    held = s.get(key(0)).value

    def hosts() -> list:
        return sorted(sk[:1] for sk in held.data)

    assert held.get(b"h0").value == b"H" * 1000 and hosts() == [b"8"] * 2 + [b"9"] * 3 + [b"h"]
    with storing_for("sybil8", "10.0.0.8"):  # (2 held: 3 after, no more than the other flooding host's 3)
        assert not s.store(key(0), b"y" * 1000, soon + 2, subkey=b"87")
    with storing_for("sybil9", "10.0.0.9"):  # (3 held: 4 after; the honest host's 1 is never its to drop)
        assert not s.store(key(0), b"y" * 1000, soon + 2, subkey=b"97")
    assert s.store(key(0), b"o" * 1000, soon, subkey=b"us")  # ours too, in place of the largest holder's
    assert hosts() == [b"8"] * 2 + [b"9"] * 2 + [b"h", b"u"]
    with storing_for("honest2", "10.0.0.2"):  # small entries: room by bytes, then by the subkey bound (8)
        assert all(s.store(key(0), b"s", soon, subkey=f"s{i}".encode()) for i in range(4))
    assert hosts() == [b"8", b"9", b"h"] + [b"s"] * 4 + [b"u"]
    assert s.held_for("sybil8") == s.held_for("sybil9") == entry  # (what was dropped no longer counts)


STORERS = [None, ("p1", "10.0.0.1"), ("p2", "10.0.0.1"), ("p3", "10.0.0.2"), ("p4", None), ("p5", None)]
BOOKED = StorageBounds(max_value_bytes=400, max_horizon=60.0, max_keys=3, max_subkeys=6, max_key_bytes=1500,
                       max_bytes=2500, max_peer_bytes=1200, max_host_bytes=1800, max_host_key_share=0.5)


@settings(max_examples=150, deadline=None)
@given(st.booleans(), st.lists(st.tuples(st.integers(0, 1), st.integers(0, 7), st.integers(1, 400),
                                         st.integers(0, len(STORERS) - 1), st.integers(1, 20), st.integers(0, 3)),
                               max_size=60))
def test_the_books_follow_what_each_key_holds(settle_always, ops):
    """Whatever is stored, by whom, expiring when (a fake clock): every key and the storage stay within their
    bounds; each dictionary's book counts every entry it holds, at its cost and for its storer, and no more than
    what has expired (:class:`~peer.net.plumbing.dht_storage._KeyBook`); settled, it counts exactly that. Books
    settled at every full key and books settled once a second decide alike on these bounds."""
    clock = [1000.0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timed_storage, "get_dht_time", lambda: clock[0])
        mp.setattr(dht_storage, "get_dht_time", lambda: clock[0])
        mp.setattr(dht_storage, "PRUNE_PERIOD", 0.0 if settle_always else 1e9)
        s = BoundedStorage(bounds=BOOKED)
        for k, sub, size, who, ttl, wait in ops:
            token = STORER.set(STORERS[who])
            try:
                s.store(key(k), bytes([sub]) * size, clock[0] + ttl, subkey=f"s{sub}".encode())
            finally:
                STORER.reset(token)
            clock[0] += wait
            used = s.used()  # (drops the keys that expired)
            held = {k: v.value for k, v in ((k, s.data.get(key(k))) for k in (0, 1)) if v is not None}
            assert sum(_held_bytes(v) for v in held.values()) <= used <= BOOKED.max_bytes
            for k, value in held.items():
                live = {sk: (_holder_of(s, key(k), sk), len(e.value) + len(sk) + 64) for sk, e in value.items()}
                assert sum(c for _, c in live.values()) <= BOOKED.max_key_bytes and len(live) <= BOOKED.max_subkeys
                book = s._book(key(k))
                assert live.items() <= book.entries.items()
                assert book.total == sum(c for _, c in book.entries.values())
                book.settled = float("-inf")  # (whatever the throttle: settled now)
                book.settle()
                assert book.entries == live
                assert dict(book.shares) == dict(sum((Counter({h: c}) for h, c in live.values()), Counter()))
                assert dict(book.counts) == dict(Counter(h for h, _ in live.values()))
                for holder, share in book.shares.items():  # (ours: any share)
                    assert holder == "" or (share <= 0.5 * BOOKED.max_key_bytes
                                            and book.counts[holder] <= 0.5 * BOOKED.max_subkeys)


def _held_bytes(value) -> int:
    return sum(len(e.value) + len(sk) + 64 for sk, e in value.items())


def _holder_of(s: BoundedStorage, k, subkey) -> str:
    charge = s._charges.get((k, subkey))
    return "" if charge is None else (charge.host or charge.peer)


def test_a_store_into_a_full_key_does_not_walk_it(monkeypatch):
    """A node serves every store of a flood: with a key full (1024 entries from four hosts), refused stores, a new
    host's store that makes room, and a whole dictionary stored again (hivemind's cache stores do) cost a few entry
    sizes each, not the key's (they walked it twice each: 1024 stores of a full key took a second of CPU)."""
    s, soon = BoundedStorage(), get_dht_time() + 30
    for i in range(BOUNDS.max_subkeys):  # (four hosts: each holds at most a quarter of a key)
        with storing_for(f"sybil{i % 8}", f"10.0.0.{8 + i % 4}"):
            assert s.store(key(0), b"x" * 900, soon, subkey=f"{i:05d}".encode())
    sizes = []
    monkeypatch.setattr(dht_storage, "_entry_cost", lambda *a, f=dht_storage._entry_cost: sizes.append(1) or f(*a))
    with storing_for("sybil0", "10.0.0.8"):
        assert not any(s.store(key(0), b"y" * 900, soon, subkey=f"new{i}".encode()) for i in range(100))
    with storing_for("honest", "10.0.0.1"):
        assert s.store(key(0), b"h" * 900, soon, subkey=b"honest")
    items = list(s.get(key(0)).value.items())
    assert all(s.store(key(0), e.value, soon + 1, subkey=sk) for sk, e in items)
    assert len(sizes) <= 3 * (100 + 1 + len(items)), len(sizes)


def test_one_host_holds_at_most_its_share_of_a_key():
    """The nodes of one host hold at most ``max_host_key_share`` of a key, in bytes and in subkeys (a node without a
    host counts alone); replacing its own entries still works, other hosts and our own stores are not held back,
    and room freed by its expired entries is its again once the key's book settles."""
    entry = 1000 + 2 + 64  # (a value of 1000 bytes at a 2-byte subkey)
    bounds = StorageBounds(max_value_bytes=1000, max_horizon=60.0, max_keys=10, max_subkeys=16,
                           max_key_bytes=8 * entry, max_bytes=100_000, max_host_key_share=0.25)  # (2 entries, 4 keys)
    s, now = BoundedStorage(bounds=bounds), get_dht_time()
    with storing_for("sybil1", "10.0.0.9"):
        assert s.store(key(0), b"x" * 1000, now + 30, subkey=b"a0")
        assert s.store(key(0), b"x" * 1000, now + 0.5, subkey=b"a1")  # (expires soon)
    with storing_for("sybil2", "10.0.0.9"):  # (the same host: its quarter of the bytes held)
        assert not s.store(key(0), b"x" * 10, now + 30, subkey=b"a2")
    with storing_for("sybil1", "10.0.0.9"):
        assert s.store(key(0), b"z" * 1000, now + 31, subkey=b"a0")  # its own entry replaced
    with storing_for("relayed", None):  # (no host: counts alone; small entries: its quarter of the subkeys)
        assert all(s.store(key(0), b"r", now + 30, subkey=f"r{i}".encode()) for i in range(4))
        assert not s.store(key(0), b"r", now + 30, subkey=b"r4")
    with storing_for("honest", "10.0.0.1"):
        assert s.store(key(0), b"h" * 1000, now + 30, subkey=b"h0")
    assert all(s.store(key(0), b"o", now + 30, subkey=f"o{i}".encode()) for i in range(5))  # ours: any share
    deadline = time.monotonic() + 5
    while s.get(key(0)).value.get(b"a1") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    with storing_for("sybil2", "10.0.0.9"):  # (a1 expired: once the key's book settles, room for one more)
        settled = time.monotonic() + dht_storage.PRUNE_PERIOD + 5
        while not s.store(key(0), b"x" * 1000, now + 30, subkey=b"a2") and time.monotonic() < settled:
            time.sleep(0.05)
        assert s.get(key(0)).value.get(b"a2") is not None
