"""What one DHT node keeps for others, bounded (hivemind's ``DHTLocalStorage`` keeps anything until it expires).

:class:`BoundedStorage` takes its place in our DHT processes (:func:`install`) and refuses a store (False, as for a
stale value) past a bound of :class:`StorageBounds`: a value's size and horizon; the keys, a key's subkeys and bytes
(a key's whole value is one DHT answer, which p2pd carries up to 4 MiB); the node's bytes; what the other node that
asks holds here, all the nodes of its host, and their share of one key (:class:`~peer.net.flow.streams.HostBook`:
loopback and relayed nodes count one by one). Our own stores count against no peer or host.
A refused store evicts nothing; one that finds its key full makes room by dropping the largest entries of the key's
largest holder (a host; a node without one; us), only while that holder holds more of the key than the storer
then would (:meth:`BoundedStorage._room`): a flood from a few hosts cannot keep a new host's record out. Every store
of a flood is checked, so a check costs the same whatever the key holds (:class:`_KeyBook`). The cache has the same
bounds. :class:`SizeGate` refuses an oversized value before any record validator reads it.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
from hivemind.utils import get_dht_time

from peer.config.fields import MAX_RECORD_TTL
from peer.net.flow.streams import UNRESOLVED, HostBook
from peer.net.plumbing.hivemind_internals import around_dht_stores, drop_expired, use_dht_storage

ENTRY_OVERHEAD = 64  # bytes counted per stored entry beyond its value and subkey (heap entry, dict slot)
PRUNE_PERIOD = 1.0  # seconds between two recounts of what other nodes hold here (each walks every such entry)
# (peer id, host) of the node whose store request this DHT node serves now; None while it stores its own
STORER: ContextVar[Optional[tuple[str, Optional[str]]]] = ContextVar("dht_storer", default=None)


@dataclass(frozen=True, kw_only=True)
class StorageBounds:
    max_value_bytes: int = 60 * 1024  # (the largest valid progress record: ~51 KB)
    max_horizon: float = MAX_RECORD_TTL
    max_keys: int = 4096
    max_subkeys: int = 1024
    # hivemind's DHT answers a find with the key's whole value, every subkey, in one message over p2pd's persistent
    # connections, which carry at most DEFAULT_MAX_MSG_SIZE (4 MiB): a larger key is unreadable (the answer fails)
    max_key_bytes: int = DEFAULT_MAX_MSG_SIZE - 256 * 1024  # (the rest: the answer's headers and peer list)
    max_bytes: int = 64 * 1024 * 1024
    # An honest peer stores its progress record (<= ~51 KB) and a few small round keys: 512 KiB is ten times that;
    # 2 MiB serves about 35 peers behind one address (a home, a campus NAT), and one host's fills no key.
    max_peer_bytes: int = 512 * 1024
    max_host_bytes: int = 2 * 1024 * 1024
    # Of one key (bytes and subkeys), one host's nodes (or one node without a host) hold at most this share: filling
    # a key takes sybils of four hosts, and those of two put half a key's bytes into every answer that reads it.
    # A quarter holds the claims of about 35 peers behind one address in groups of 64.
    max_host_key_share: float = 0.25


BOUNDS = StorageBounds()


def _subkey_bytes(subkey: Any) -> int:
    return len(subkey) if isinstance(subkey, (bytes, str)) else 16


def _entry_cost(value: Any, subkey: Any = None) -> int:
    return len(value) + (0 if subkey is None else _subkey_bytes(subkey)) + ENTRY_OVERHEAD


@dataclass(frozen=True)
class _Charge:
    """An entry another node stored here: who (its peer id and host) and what it costs."""

    peer: str
    host: Optional[str]
    cost: int


def _holder(storer: Optional[tuple[str, Optional[str]]]) -> str:
    """Whose share of a key an entry counts in: its storer's host, the storer itself where it has none (loopback,
    relayed), or "" for what no other node stored (ours)."""
    return "" if storer is None else (storer[1] or storer[0])


class _KeyBook:
    """What one dictionary value of the storage holds, kept as its entries are stored and dropped, so that checking a
    store does not walk the key: each subkey's holder and cost, their sum, and each holder's share. Entries that
    expire are counted until :meth:`settle` (stale-high: a book refuses more, never admits past a bound). Written
    only by its :class:`BoundedStorage`."""

    __slots__ = ("value", "entries", "total", "shares", "counts", "settled")

    def __init__(self, value: DictionaryDHTValue):
        self.value = value  # (the dictionary it books: a key's new dictionary gets a new book)
        self.entries: dict[Any, tuple[str, int]] = {}
        self.total = 0
        self.shares: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()  # each holder's entries
        self.settled = float("-inf")  # when settle last ran (time.monotonic())

    def put(self, subkey: Any, holder: str, cost: int) -> None:
        self.drop(subkey)
        self.entries[subkey] = (holder, cost)
        self.total += cost
        self.shares[holder] += cost
        self.counts[holder] += 1

    def drop(self, subkey: Any) -> None:
        held = self.entries.pop(subkey, None)
        if held is not None:
            holder, cost = held
            self.total -= cost
            self.shares[holder] -= cost
            self.counts[holder] -= 1
            if self.counts[holder] <= 0:
                del self.shares[holder], self.counts[holder]

    def held_by(self, holder: str, subkey: Any) -> tuple[int, int]:
        """The bytes and entries ``holder`` holds of the key, less the entry at ``subkey`` if it is theirs."""
        size, count = self.shares[holder], self.counts[holder]
        held = self.entries.get(subkey)
        return (size - held[1], count - 1) if held is not None and held[0] == holder else (size, count)

    def cost(self, subkey: Any) -> int:
        held = self.entries.get(subkey)
        return 0 if held is None else held[1]

    def settle(self) -> bool:
        """Forgets the entries the dictionary no longer holds (expired), at most once per PRUNE_PERIOD (it walks
        the key); whether it did."""
        if time.monotonic() - self.settled < PRUNE_PERIOD:
            return False
        self.settled = time.monotonic()
        drop_expired(self.value)
        for subkey in [sk for sk in self.entries if sk not in self.value.data]:
            self.drop(subkey)
        return True


class BoundedStorage(DHTLocalStorage):
    """``DHTLocalStorage`` that refuses what would pass its :class:`StorageBounds`. Used by one DHT node's event loop
    (hivemind's protocol), the only writer; a store serves another node while :data:`STORER` names it."""

    def __init__(self, maxsize: Optional[int] = None, *, bounds: StorageBounds = BOUNDS):
        super().__init__(maxsize)
        self.bounds = bounds
        self._sizes: dict[Any, int] = {}  # key -> bytes it held when last stored to (stale-high once entries expire)
        self._used = 0  # their sum
        self._books: dict[Any, _KeyBook] = {}  # key -> its dictionary's book
        # (key, subkey) -> who stored it from afar; and their sums, stale-high until a recount (:meth:`_recount`)
        self._charges: dict[tuple[Any, Any], _Charge] = {}
        self._by_peer: Counter[str] = Counter()
        self._by_host: Counter[str] = Counter()
        self._counted = float("-inf")  # when the last recount ran (time.monotonic())

    def used(self) -> int:
        """Bytes held (counted when each key was last stored to)."""
        drop_expired(self)
        if len(self._sizes) != len(self.data):  # (keys expired: every key held was counted when stored)
            self._sizes = {k: n for k, n in self._sizes.items() if k in self.data}
            self._books = {k: book for k, book in self._books.items() if k in self.data}
            self._used = sum(self._sizes.values())
        return self._used

    def store(self, key, value, expiration_time, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if not self._admits(key, None, value, expiration_time):
            return False
        ok = super().store(key, value, expiration_time)
        self._account(key)
        if ok:
            self._charge(key, None, _entry_cost(value))
        return ok

    def store_subkey(self, key, subkey, value, expiration_time) -> bool:
        if not self._admits(key, subkey, value, expiration_time):
            return False
        ok = super().store_subkey(key, subkey, value, expiration_time)
        if ok:
            self._charge(key, subkey, _entry_cost(value, subkey))
            self._book(key).put(subkey, _holder(STORER.get()), _entry_cost(value, subkey))
        self._account(key)
        return ok

    def held_for(self, peer: str) -> int:
        """Bytes that ``peer``'s store requests hold here (counted when stored: stale-high until a recount)."""
        return self._by_peer[peer]

    def _admits(self, key, subkey, value, expiration_time: float) -> bool:
        b = self.bounds
        if not isinstance(value, (bytes, bytearray)) or len(value) > b.max_value_bytes:
            return False
        if not expiration_time <= get_dht_time() + b.max_horizon:  # (also refuses NaN)
            return False
        used, new, storer = self.used(), _entry_cost(value, subkey), STORER.get()
        held = self.data.get(key)
        book: Optional[_KeyBook] = None
        room: list = []  # subkeys the store drops (_room)
        if held is None:
            if len(self.data) >= b.max_keys:
                return False
            old = 0
        elif subkey is None or not isinstance(held.value, DictionaryDHTValue):
            old = self._sizes.get(key, 0)  # (a plain value, or a dictionary a plain value would replace)
        else:
            book = self._book(key)
            old = book.cost(subkey)
            if storer is not None and not self._within_share(book, subkey, new, _holder(storer)):
                return False
            dropped = self._room(book, subkey, new, _holder(storer))
            if dropped is None:
                return False
            room = dropped
        freed = 0 if book is None else sum(book.cost(sk) for sk in room)
        if not (used - old - freed + new <= b.max_bytes and new <= b.max_key_bytes):
            return False
        if storer is not None and not self._within_quota(key, subkey, storer, new):
            return False
        for sk in room:  # (dropped only once the store is admitted)
            assert book is not None
            del book.value[sk]
            book.drop(sk)
            self._uncharge(key, sk)
        return True

    def _book(self, key) -> _KeyBook:
        """The book of the dictionary held at ``key`` (made by walking it where the dictionary is new to us)."""
        value = self.data[key].value
        book = self._books.get(key)
        if book is None or book.value is not value:
            book = self._books[key] = _KeyBook(value)
            for sk, e in value.items():
                charge = self._charges.get((key, sk))
                book.put(sk, "" if charge is None else _holder((charge.peer, charge.host)), _entry_cost(e.value, sk))
            book.settled = time.monotonic()
        return book

    def _within_share(self, book: _KeyBook, subkey, new: int, holder: str) -> bool:
        """Whether ``holder`` (another node's host, or that node) may hold an entry of ``new`` bytes at ``subkey``:
        at most ``max_host_key_share`` of the key's bytes and of its subkeys, with the entry."""
        b = self.bounds

        def fits() -> bool:
            size, count = book.held_by(holder, subkey)
            return (size + new <= b.max_host_key_share * b.max_key_bytes
                    and count + 1 <= b.max_host_key_share * b.max_subkeys)

        return fits() or (book.settle() and fits())

    def _room(self, book: _KeyBook, subkey, new: int, me: str) -> Optional[list]:
        """The subkeys to drop so that an entry of ``new`` bytes at ``subkey``, stored by holder ``me``, fits its key
        (bytes and subkeys): each the largest entry of the holder that then holds the most of the key, as long as
        that holder holds more of it than ``me`` would with the new entry; None if the entry cannot fit so. Walks
        the key only to settle its book (at most once per PRUNE_PERIOD) and to pick what to drop."""
        b = self.bounds

        def size_and_count() -> tuple[int, int]:  # (the key's, after the store)
            return book.total - book.cost(subkey) + new, len(book.entries) + (subkey not in book.entries)

        size, count = size_and_count()
        if (size > b.max_key_bytes or count > b.max_subkeys) and book.settle():
            size, count = size_and_count()
        if size <= b.max_key_bytes and count <= b.max_subkeys:
            return []
        shares = Counter(book.shares)
        if subkey in book.entries:  # (the entry the store replaces counts for nobody)
            shares[book.entries[subkey][0]] -= book.cost(subkey)
        mine = shares[me] + new
        drop: list = []
        largest_first: dict[str, list[tuple[int, Any]]] = {}
        while size > b.max_key_bytes or count > b.max_subkeys:
            largest = max((h for h in shares if h != me), key=shares.__getitem__, default=None)
            if largest is None or shares[largest] <= mine:
                return None
            if largest not in largest_first:
                largest_first[largest] = sorted(((c, sk) for sk, (h, c) in book.entries.items()
                                                 if h == largest and sk != subkey), key=lambda e: e[0])
            cost, sk = largest_first[largest].pop()
            shares[largest] -= cost
            size, count = size - cost, count - 1
            drop.append(sk)
        return drop

    def _within_quota(self, key, subkey, storer: tuple[str, Optional[str]], new: int) -> bool:
        """Whether ``storer``'s node, and its host's, may hold ``new`` more bytes here (less what the entry it
        replaces cost them). Over the bound, the sums are recounted first (at most once per PRUNE_PERIOD: each
        recount walks every entry other nodes stored, and a flood makes many refusals)."""
        peer, host = storer

        def fits() -> bool:
            prev = self._charges.get((key, subkey))
            mine = new - (prev.cost if prev is not None and prev.peer == peer else 0)
            ours = new - (prev.cost if prev is not None and prev.host == host else 0)
            return (self._by_peer[peer] + mine <= self.bounds.max_peer_bytes
                    and (host is None or self._by_host[host] + ours <= self.bounds.max_host_bytes))

        if fits():
            return True
        if time.monotonic() - self._counted < PRUNE_PERIOD:
            return False
        self._recount()
        return fits()

    def _recount(self) -> None:
        """Drops the charges of entries that are gone (expired, or replaced by another kind of value)."""
        self._counted = time.monotonic()
        drop_expired(self)
        for (key, subkey), charge in list(self._charges.items()):
            held = self.data.get(key)
            dictionary = held is not None and isinstance(held.value, DictionaryDHTValue)
            if held is None or (subkey is None) == dictionary or (dictionary and held.value.get(subkey) is None):
                self._uncharge(key, subkey)

    def _charge(self, key, subkey, cost: int) -> None:
        """After a store: the entry is the storer's now (ours: nobody's)."""
        self._uncharge(key, subkey)
        storer = STORER.get()
        if storer is not None:
            peer, host = storer
            self._charges[(key, subkey)] = _Charge(peer, host, cost)
            self._by_peer[peer] += cost
            if host is not None:
                self._by_host[host] += cost

    def _uncharge(self, key, subkey) -> None:
        charge = self._charges.pop((key, subkey), None)
        if charge is None:
            return
        self._by_peer[charge.peer] -= charge.cost
        if self._by_peer[charge.peer] <= 0:
            del self._by_peer[charge.peer]
        if charge.host is not None:
            self._by_host[charge.host] -= charge.cost
            if self._by_host[charge.host] <= 0:
                del self._by_host[charge.host]

    def _account(self, key) -> None:
        """After a store: the key's size, and the storage's."""
        held = self.data.get(key)
        if held is None or not isinstance(held.value, DictionaryDHTValue):
            self._books.pop(key, None)
        size = 0 if held is None else (self._book(key).total if isinstance(held.value, DictionaryDHTValue)
                                       else _entry_cost(held.value))
        self._used += size - self._sizes.pop(key, 0)
        if held is not None:
            self._sizes[key] = size


class SizeGate(RecordValidatorBase):
    """The first record validator of every node of ours: a value larger than ``max_value_bytes`` (signature
    included, as the storage counts it) is refused before the signature search, msgpack and the record's schema
    read it, since :class:`BoundedStorage` would refuse it anyway. Stateless."""

    def __init__(self, bounds: StorageBounds = BOUNDS):
        self.bounds = bounds

    def validate(self, record: DHTRecord) -> bool:
        return len(record.value) <= self.bounds.max_value_bytes

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    @property
    def priority(self) -> int:
        return 1 << 30  # validators run in decreasing priority: this one before the others

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SizeGate)


def install(*, list_timeout: float = 5.0) -> None:
    """In the DHT process, before its node starts: hivemind's protocol creates its storage and cache from
    :class:`BoundedStorage` (it looks the class up in its module when the node starts), and serves other nodes'
    stores naming them in :data:`STORER` (their hosts from the daemon's connections, listed within
    ``list_timeout`` s)."""
    use_dht_storage(BoundedStorage)
    around_dht_stores(lambda rpc_store: _naming_the_storer(rpc_store, HostBook(), list_timeout))


def _naming_the_storer(rpc_store: Callable, hosts: HostBook, list_timeout: float) -> Callable:
    @functools.wraps(rpc_store)  # (hivemind registers a handler by its type hints: the wrapped one's)
    async def rpc_store_naming_the_storer(protocol, request, context):
        peer = str(context.remote_id)
        host = hosts.host(peer)
        if host == UNRESOLVED:  # (such nodes share one budget until the listing names their hosts)
            hosts.list_soon(protocol.p2p, list_timeout)
        token = STORER.set((peer, host))
        try:
            return await rpc_store(protocol, request, context)
        finally:
            STORER.reset(token)
    return rpc_store_naming_the_storer
