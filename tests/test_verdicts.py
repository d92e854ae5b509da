"""Verdicts on DHT records remembered by their bytes (peer/net/trust/verdicts.py)."""

import dataclasses
import pickle

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPublicKey

from peer.net.plumbing.addresses import ensure_identity
from peer.net.trust import progress
from peer.net.trust.progress import ProgressValidator, progress_key
from peer.net.trust.verdicts import Verdicts
from test_progress import identity_signers, rec

dumps = DHTProtocol.serializer.dumps


def test_a_verdict_is_remembered_for_the_same_bytes_only_and_for_the_last_records():
    """The same key, subkey, value and expiration: one validation, its verdict (False too) given again; any field
    changed is another record; past ``size`` the oldest verdict is forgotten."""
    calls = []

    def validate(record: DHTRecord) -> bool:
        calls.append(record)
        return record.value != b"bad"

    v = Verdicts(size=3)
    base = DHTRecord(b"k", b"s", b"v", 10.0)
    assert [v.check(base, validate) for _ in range(3)] == [True] * 3 and len(calls) == 1
    variants = [dataclasses.replace(base, **change) for change in
                ({"key": b"k2"}, {"subkey": b"s2"}, {"value": b"bad"}, {"expiration_time": 10.5})]
    assert [v.check(r, validate) for r in variants] == [True, True, False, True] and len(calls) == 5
    assert not v.check(variants[2], validate) and len(calls) == 5  # (a refusal is remembered too)
    assert v.check(base, validate) and len(calls) == 6  # (forgotten: three records came after it)
    assert v.check(DHTRecord(b"k", None, b"v", 10.0), validate) and len(calls) == 7  # (no subkey: another record)
    copy = pickle.loads(pickle.dumps(v))  # (validators may travel to another process: nothing remembered there)
    assert copy.check(base, validate) and len(calls) == 8 and copy.size == 3


def test_signatures_and_open_records_are_checked_once_and_forgeries_still_fail(tmp_path, monkeypatch):
    """A peer's validators (an open run) check a record's owner signature and schema once however often it is read;
    a forged signature, a record changed under a valid signature, and another owner's subkey still fail."""
    run_key = "testrun_verdicts"
    (validators, subkey), (_, other_subkey) = identity_signers(run_key, tmp_path, 2)
    mine = ensure_identity(tmp_path / "n0.id")
    signer = validators[1]
    verified, parsed = [], []
    verify = RSAPublicKey.verify
    monkeypatch.setattr(RSAPublicKey, "verify", lambda *a: verified.append(1) or verify(*a))
    check = ProgressValidator._check
    monkeypatch.setattr(ProgressValidator, "_check", lambda *a: parsed.append(1) or check(*a))

    def signed(value, sub: bytes = subkey, expires: float = get_dht_time() + 30) -> DHTRecord:
        record = DHTRecord(DHTID.generate(source=progress_key(run_key)).to_bytes(), dumps(sub), dumps(value), expires)
        return dataclasses.replace(record, value=signer.sign_value(record))

    good = signed(rec(mine, 1.0))
    assert all(CompositeValidator(validators).validate(good) for _ in range(5))
    assert len(verified) == 1 and len(parsed) == 1
    changed = dataclasses.replace(good, value=good.value.replace(dumps(rec(mine, 1.0)), dumps(rec(mine, 2.0))))
    assert changed.value != good.value and not CompositeValidator(validators).validate(changed)
    assert not CompositeValidator(validators).validate(dataclasses.replace(good, value=good.value[:-3] + b"xx]"))
    assert not CompositeValidator(validators).validate(signed(rec(mine, 1.0), other_subkey))


def test_records_of_an_authenticated_run_are_checked_every_time(tmp_path, monkeypatch):
    """With a pass checker the verdict is not the record's alone (a pass expires, or is revoked): nothing is
    remembered."""
    run_key = "testrun_verdicts_auth"
    (validators, subkey), = identity_signers(run_key, tmp_path, 1)
    mine = ensure_identity(tmp_path / "n0.id")
    admitted = [True]
    monkeypatch.setattr(progress, "record_admitted", lambda *a: admitted[0])
    checks = ProgressValidator(run_key, checker=object())  # type: ignore[arg-type]
    record = DHTRecord(DHTID.generate(source=progress_key(run_key)).to_bytes(), dumps(subkey), dumps(rec(mine, 1.0)),
                       get_dht_time() + 30)
    assert checks.validate(record)
    admitted[0] = False  # (its pass revoked)
    assert not checks.validate(record)
