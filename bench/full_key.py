"""What a full DHT key costs the node that holds or reads it, per operation, CPU only (no network).

    .venv/bin/python bench/full_key.py [--entries 1024] [--value-bytes 900] [--hosts 4] [--repeats 3]

Storage (peer/net/plumbing/dht_storage.py ``BoundedStorage``, the default bounds): a key filled with ``--entries``
entries of ``--value-bytes`` from ``--hosts`` hosts (one holds at most a quarter of a key), then timed: the whole
key stored again entry by entry (as hivemind serves another node's store of a whole dictionary, its caching), the
same from another host, 100 stores of new subkeys from one of the filling hosts (refused), and a new host's entry
(room made, where the tree has the rule).
Records (peer/net/trust/progress.py ``make_validators``, an open run): ``--entries`` progress records, signed by
16 identity keys in turn, checked as hivemind checks a find answer's dictionary (``CompositeValidator``), twice: the
second pass is what every later read of the same records costs. Run it in worktrees to compare commits.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IDENTITIES = 16  # signers of the records


def storage_times(entries: int, size: int, hosts: int) -> dict[str, float]:
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    from peer.net.plumbing import dht_storage as ds

    s, key, soon = ds.BoundedStorage(), DHTID.generate(source="full"), get_dht_time() + 300

    def stored(who, subkey: bytes, value: bytes, expires: float) -> bool:
        token = ds.STORER.set(who)
        try:
            return s.store(key, value, expires, subkey=subkey)
        finally:
            ds.STORER.reset(token)

    for i in range(entries):
        stored((f"sybil{i % 8}", f"10.0.0.{8 + i % hosts}"), f"{i:05d}".encode(), os.urandom(size), soon)
    items = [(sk, e.value) for sk, e in s.get(key).value.items()]
    out = {}
    for name, who in (("whole key again, ours", None), ("whole key again, a third host", ("x", "10.0.0.3"))):
        t = time.perf_counter()
        for sk, value in items:
            stored(who, sk, value, soon + 1)
        out[name] = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(100):
        stored(("sybil0", "10.0.0.8"), f"new{i}".encode(), os.urandom(size), soon)
    out["100 new subkeys, a filling host"] = time.perf_counter() - t
    t = time.perf_counter()
    made = stored(("honest", "10.0.0.1"), b"honest", os.urandom(size), soon)
    out[f"a new host's entry ({'admitted' if made else 'refused'})"] = time.perf_counter() - t
    return out


def record_times(entries: int, folder: Path) -> dict[str, float]:
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import CompositeValidator, DHTRecord
    from hivemind.utils import get_dht_time

    from peer.net.plumbing.addresses import ensure_identity
    from peer.net.trust.auth import identity_key
    from peer.net.trust.progress import make_validators, progress_key
    from peer.net.trust.records import ProgressRecord

    dumps, key = DHTProtocol.serializer.dumps, DHTID.generate(source=progress_key("bench")).to_bytes()
    signers = []
    for i in range(IDENTITIES):  # (a key each is minutes of RSA key generation: records differ by their step)
        peer_id = ensure_identity(folder / f"id{i}")
        signers.append((peer_id, *make_validators("bench", identity_key(folder / f"id{i}"))))
    checks, records = signers[0][1], []
    for i in range(entries):
        peer_id, validators, subkey = signers[i % IDENTITIES]
        value = ProgressRecord(peer_id=peer_id, step=i, round=0, tokens_per_second=1.0, client_mode=False,
                               time=1.0).model_dump()
        record = DHTRecord(key, dumps(subkey), dumps(value), get_dht_time() + 300)
        records.append(dataclasses.replace(record, value=validators[1].sign_value(record)))
    composite, out = CompositeValidator(checks), {}
    for name in ("first check of each record", "second check of each record"):
        t = time.perf_counter()
        ok = sum(composite.validate(r) for r in records)
        out[f"{name} ({ok} valid)"] = time.perf_counter() - t
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=1024)
    ap.add_argument("--value-bytes", type=int, default=900)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hosts", type=int, default=4, help="the hosts that fill the key")
    ap.add_argument("--records-dir", type=Path, default=Path("/tmp/full_key_ids"))
    args = ap.parse_args()
    args.records_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, seconds in {**storage_times(args.entries, args.value_bytes, args.hosts),
                              **record_times(args.entries, args.records_dir)}.items():
            rows.setdefault(name, []).append(seconds)
    print(f"| {args.entries} entries | ms, each of {args.repeats} runs |\n| --- | --- |")
    for name, seconds in rows.items():
        print(f"| {name} | {' / '.join(f'{1000 * s:.1f}' for s in seconds)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
