"""Verdicts on DHT records, remembered by the records' bytes: a record is checked once, not at every read.

hivemind's DHT node checks every entry of a dictionary value each time another node answers a find with it (every
lookup, a store's too, reads the key's whole value from each node it asks) and each entry of a whole dictionary
another node stores with it (hivemind's caching). Under a progress key that sybils keep full, that was a thousand
RSA signatures and record schemas per answer, and an honest DHT process fell a hundred requests behind. A validator
whose verdict is a function of the record's bytes (its key, subkey, value and expiration: a signature, a schema)
remembers it in :class:`Verdicts`; one that also asks something that changes (a pass that may expire or be
revoked) does not.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable, Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

SIZE = 1 << 15  # verdicts remembered per validator (~5 MB): a full progress key is 1024 records


def _digest(record: DHTRecord) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in (record.key, record.subkey if record.subkey is not None else b"", record.value):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(repr(float(record.expiration_time)).encode())
    return h.digest()


class Verdicts:
    """The last ``size`` verdicts of one validator, by a digest of the record (``check``). The DHT process's event
    loop and its owner's threads may validate at once: a lock guards the table, not the validation."""

    def __init__(self, size: int = SIZE):
        self.size = size
        self._seen: OrderedDict[bytes, bool] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # (a copy, pickled or not, starts with no verdicts and its own lock)
        return {"size": self.size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["size"])  # type: ignore[misc]

    def check(self, record: DHTRecord, validate: Callable[[DHTRecord], bool]) -> bool:
        """``validate(record)``, or what it said of the same bytes before."""
        digest = _digest(record)
        with self._lock:
            verdict = self._seen.get(digest)
            if verdict is not None:
                self._seen.move_to_end(digest)
                return verdict
        verdict = bool(validate(record))
        with self._lock:
            self._seen[digest] = verdict
            while len(self._seen) > self.size:
                self._seen.popitem(last=False)
        return verdict


class RememberedSignatures(RSASignatureValidator):
    """hivemind's owner-signature validator, its verdicts remembered (:class:`Verdicts`): whether a record's
    signature is its owner's is a function of the record's bytes."""

    def __init__(self, private_key: Optional[RSAPrivateKey] = None):
        super().__init__(private_key)
        self._verdicts = Verdicts()

    def validate(self, record: DHTRecord) -> bool:
        return self._verdicts.check(record, super().validate)
