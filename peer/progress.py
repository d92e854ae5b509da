"""Signed progress records in the DHT: who is training this run, how far, how fast.

Each peer stores one record under ``{run_key}_progress`` with a subkey carrying its RSA public key,
so only it can overwrite its record (hivemind's RSASignatureValidator), and the value must match
:class:`ProgressRecord` (hivemind's SchemaValidator): a malformed record from another peer is
rejected by every DHT node that validates. A record expires after ``progress_ttl`` seconds, so a
crashed peer stops counting as live on its own.
"""

from __future__ import annotations

import re
from typing import Optional

import pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

_OWNER = re.compile(b".*" + RSASignatureValidator.PUBLIC_KEY_REGEX + b".*", re.DOTALL)


class ProgressRecord(pydantic.BaseModel):
    """One peer's progress (values are checked strictly: they come from other peers)."""

    peer_id: pydantic.StrictStr
    step: pydantic.conint(strict=True, ge=0)
    round: pydantic.conint(strict=True, ge=0)  # rounds completed of fragment 0
    # per fragment: rounds applied and the hex digest of G after them (drift check, state donors)
    rounds: list[pydantic.conint(strict=True, ge=0)] = pydantic.Field(default_factory=list, max_length=4096)
    digests: list[pydantic.constr(strict=True, max_length=64)] = pydantic.Field(default_factory=list,
                                                                               max_length=4096)
    tokens_per_second: pydantic.confloat(strict=True, ge=0.0, allow_inf_nan=False)
    client_mode: pydantic.StrictBool
    time: pydantic.confloat(strict=True, allow_inf_nan=False)


class ProgressValidator(RecordValidatorBase):
    """Accepts a record under the progress key only if its subkey carries an owner's public key
    (so the signature validator enforces ownership) and its value is a valid ProgressRecord.

    hivemind's SchemaValidator and BytesWithPublicKey rely on pydantic-v1 internals that pydantic 2
    rejects, so this is the same rule written for pydantic 2. Other keys are not our business.
    """

    def __init__(self, run_key: str):
        self._key_id = DHTID.generate(source=progress_key(run_key)).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key_id:
            return True
        try:
            subkey = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value)
            if not isinstance(subkey, bytes) or not _OWNER.fullmatch(subkey):
                return False
            return value is None or ProgressRecord.model_validate(value) is not None
        except (ValueError, TypeError, pydantic.ValidationError, Exception):
            return False


def make_validators(run_key: str) -> tuple[list[RecordValidatorBase], bytes]:
    """Record validators for the DHT and the subkey under which this process signs its record.

    Must be created before the DHT process is started (validators are handed to it).
    """
    signer = RSASignatureValidator()
    return [ProgressValidator(run_key), signer], signer.local_public_key


def progress_key(run_key: str) -> str:
    return f"{run_key}_progress"


def parse_records(found, now: float) -> dict[str, ProgressRecord]:
    """Live records by peer id from a ``dht.get(progress_key, latest=True)`` result; invalid ones are skipped."""
    out: dict[str, ProgressRecord] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    for entry in found.value.values():
        if entry.expiration_time < now or entry.value is None:
            continue
        try:
            rec = ProgressRecord.model_validate(entry.value)
        except pydantic.ValidationError:
            continue
        out[rec.peer_id] = rec
    return out
