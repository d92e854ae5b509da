"""What one DHT node keeps for others, bounded.

hivemind's ``DHTLocalStorage`` keeps every record anyone stores, of any size and count, until its writer's expiration.
:class:`BoundedStorage` takes its place in our DHT processes (:func:`install`, before the node starts) and refuses a
store (False, as hivemind answers for a stale value) whose

- value is larger than ``max_value_bytes`` (the largest valid progress record is ~51 KB),
- expiration lies more than ``max_horizon`` seconds ahead (our records live seconds to minutes),
- key is new while ``max_keys`` keys are held, or subkey is new while its key holds ``max_subkeys``,
- size would take its key past ``max_key_bytes`` (a key's whole value is one DHT answer: p2pd carries up to 4 MiB),
- size would take what the node holds past ``max_bytes`` (values and subkeys, as stored).

A refused store evicts nothing: a flood cannot push honest records out, only fill the budget for as long as its own
records live (at most ``max_horizon``); peers refresh their records every beat. The cache has the same bounds.
:class:`SizeGate` refuses an oversized value before any record validator reads it (each reads every byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
from hivemind.utils import get_dht_time

from peer.config.fields import MAX_RECORD_TTL
from peer.net.plumbing.hivemind_internals import drop_expired, use_dht_storage

ENTRY_OVERHEAD = 64  # bytes counted per stored entry beyond its value and subkey (heap entry, dict slot)


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


BOUNDS = StorageBounds()


def _subkey_bytes(subkey: Any) -> int:
    return len(subkey) if isinstance(subkey, (bytes, str)) else 16


def _entry_cost(value: Any, subkey: Any = None) -> int:
    return len(value) + (0 if subkey is None else _subkey_bytes(subkey)) + ENTRY_OVERHEAD


def _key_cost(value: DictionaryDHTValue) -> int:
    """What a dictionary holds now (its expired subkeys dropped as it is read)."""
    return sum(_entry_cost(e.value, sk) for sk, e in value.items())


class BoundedStorage(DHTLocalStorage):
    """``DHTLocalStorage`` that refuses what would pass its :class:`StorageBounds`. Used by one DHT node's event loop
    (hivemind's protocol), the only writer."""

    def __init__(self, maxsize: Optional[int] = None, *, bounds: StorageBounds = BOUNDS):
        super().__init__(maxsize)
        self.bounds = bounds
        self._sizes: dict[Any, int] = {}  # key -> bytes it held when last stored to (stale-high once entries expire)

    def used(self) -> int:
        """Bytes held (counted when each key was last stored to)."""
        drop_expired(self)
        self._sizes = {k: n for k, n in self._sizes.items() if k in self.data}
        return sum(self._sizes.values())

    def store(self, key, value, expiration_time, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if not self._admits(key, None, value, expiration_time):
            return False
        ok = super().store(key, value, expiration_time)
        self._account(key)
        return ok

    def store_subkey(self, key, subkey, value, expiration_time) -> bool:
        if not self._admits(key, subkey, value, expiration_time):
            return False
        ok = super().store_subkey(key, subkey, value, expiration_time)
        self._account(key)
        return ok

    def _admits(self, key, subkey, value, expiration_time: float) -> bool:
        b = self.bounds
        if not isinstance(value, (bytes, bytearray)) or len(value) > b.max_value_bytes:
            return False
        if not expiration_time <= get_dht_time() + b.max_horizon:  # (also refuses NaN)
            return False
        used, new = self.used(), _entry_cost(value, subkey)
        held = self.data.get(key)
        if held is None:
            if len(self.data) >= b.max_keys:
                return False
            old = 0
        elif subkey is None or not isinstance(held.value, DictionaryDHTValue):
            old = self._sizes.get(key, 0)  # (a plain value, or a dictionary a plain value would replace)
        else:
            entry = held.value.get(subkey)
            if entry is None and len(held.value) >= b.max_subkeys:
                return False
            old = 0 if entry is None else _entry_cost(entry.value, subkey)
            if _key_cost(held.value) - old + new > b.max_key_bytes:
                return False
        return used - old + new <= b.max_bytes and new <= b.max_key_bytes

    def _account(self, key) -> None:
        held = self.data.get(key)
        if held is None:
            self._sizes.pop(key, None)
        elif isinstance(held.value, DictionaryDHTValue):
            self._sizes[key] = _key_cost(held.value)
        else:
            self._sizes[key] = _entry_cost(held.value)


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


def install() -> None:
    """In the DHT process, before its node starts: hivemind's protocol creates its storage and cache from
    :class:`BoundedStorage` (it looks the class up in its module when the node starts)."""
    use_dht_storage(BoundedStorage)
