"""A hostile peer for bench/swarm_attacks.py: the real peer with one behaviour changed, as an attacker would
change their own copy of the client.

    python bench/hostile_peer.py ATTACK run [swarm-peer run flags...]

ATTACK is one of:

- ``lying_reducer``: as a reducer, returns the negation of the honest aggregate of its span (same size, so
  only the members' direction check can tell);
- ``erring_reducer``: as a reducer, answers every member's part with an error (its own parts it sends): its span
  is missing in every round it is in, and a round applies all spans or none;
- ``two_faced_reducer``: as a reducer, sends its honest average to the members of even index and the same
  average x1.02, encoded anew and signed, to the others: plausible to every check of one member's, but two versions
  of one round;
- ``round_breaker``: sends every reducer a part scaled by 1e30 and never answers as a reducer (its span's
  members wait until allreduce_timeout);
- ``sybil_majority``: publishes a state of its own (its G negated, with the matching digest) and six more
  progress records of sybils claiming that same state (a "majority" of 7 against 4), each sybil with its own
  key, its id that key's hash, so that its records are valid;
- ``shadowing``: publishes the same forged state, and records under the honest peers' own ids claiming it,
  1,000 rounds and 10^6 steps ahead (issue 28; signed with its own key, the only one it holds);
- ``far_ahead``: publishes the same forged state and a record claiming to be 1,000 rounds and 10^6 steps ahead;
- ``served_ahead``: the same, serving the forged state under the round and digest its record claims;
- ``forged_donor``: advertises the swarm's digest but serves a negated G to whoever downloads from it;
- ``stream_hog``: ``HOG_IDENTITIES`` more identities on this peer's host (each its own libp2p daemon) open
  ``HOG_STREAMS`` streams each to every peer this one is connected to (the reduce and download handlers in
  turn), send nothing, hold them, and open new ones as the peers close them (issue 28's exhaustion);
- ``record_flood``: stores ``FLOOD_RECORDS`` records of 1 MiB each under the run's progress key at every beat.
- ``key_fill``: stores ``FILL_SYBILS`` valid progress records of sybils (each self-certifying, its lists at their
  bounds: ~45 KB) under the run's progress key at every beat, more than a key holds (3.75 MiB), from its one DHT node.
- ``host_fill``: ``key_fill`` from as many DHT nodes as its host's share of another node's storage takes: another node
  keeps at most 512 KiB of what one node stores there and 2 MiB of its host's (peer/net/plumbing/dht_storage.py), so
  ``FILL_NODES`` more nodes on this host (client mode: they store, nobody stores at them) and this peer's node store,
  each its share, ``HOST_FILL_SYBILS`` sybil records with their lists full (~47 KB) and ``HOST_FILL_SMALL`` as small
  as a record may be (~950 bytes with its subkey, under suffixes of the sybils' subkeys: less than an honest
  record), which fill what room the large ones leave, at every beat (each paused where this peer's record is: a
  swarm that counts them live runs its rounds in two levels), each to expire ``FILL_TTL`` s later (so that a
  store that lags under load leaves no gap). Two such hosts fill the progress key (2 x 2 MiB > 3.75 MiB) at every
  node. It reads the others' records only every ``FILL_READ_PERIOD`` s (each read of full keys costs it as much as
  anyone).
- ``phantom_group``: leads every round it can (it declares its search ending after ``PHANTOM_SEARCH_S`` instead of
  the run's matchmaking time, so honest followers ask it first), takes one honest follower, refuses the others, and
  assembles a group of the two and ``PHANTOMS`` made-up ids: client-mode members (no span) whose infos declare the
  honest base and a count of 1, so that the group's verdict says apply while the others meet and apply apart.
- ``equivocator``: once every live peer has been its group partner (so every honest peer counts it), sends its one
  id to two groups of each round it can: it leads one (declaring its search ending after ``EQUIVOCATOR_LEAD_S``, so
  honest followers ask it first), takes followers until the group holds a quorum of the count it declared
  (``quorum_size``), assembles at once and refuses the rest; those meet in a group of their own, which a second,
  follower-only matchmaking of this peer (hivemind's client mode: it declares nothing) then joins with the same
  member info. Both groups hold a majority of the peers each member counts, both reduce (this peer in both, at
  once), and both apply: the two halves of the honest peers end the round on two digests. Rounds where it leads no
  group capped at the quorum proceed as the honest peer's (one group). It signs a member claim for each of its
  groups (peer/net/trust/claims.py; an honest signer signs one per round).

Every forged thing is logged on this process's console ("HOSTILE: ..."), so a bench can count it. Not part
of the product: it imports it and patches it in this process only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("hostile")
SYBILS = 6
HOG_IDENTITIES, HOG_STREAMS = 34, 16  # issue 28: 34 identities, each up to the per-peer stream budget
FLOOD_RECORDS, FLOOD_BYTES = 40, 1 << 20
FILL_SYBILS = 90  # x ~45 KB: past the 3.75 MiB a progress key holds
# host_fill: 5 nodes x 512 KiB > the 2 MiB a host's nodes hold at another node; 48 x ~47 KB > 2 MiB; 100 x ~1 KB:
# more than the room 47 KB entries leave (< 47 KB at the key's bound, < 47 KB at the host's)
FILL_NODES, HOST_FILL_SYBILS, HOST_FILL_SMALL = 4, 48, 100
FILL_TTL = 600.0  # host_fill's records expire this long after each store (a node keeps one up to an hour)
FILL_READ_PERIOD = 30.0  # host_fill reads the records at most this often (a read of full keys is costly)
PHANTOMS, PHANTOM_SEARCH_S = 4, 1.0
EQUIVOCATOR_LEAD_S = 4.0  # its lead declaration's search time (honest peers declare --matchmaking-time, 10 s)


def lying_reducer() -> None:
    from peer.net.round import allreduce

    honest = allreduce.SpanReduction._combine

    async def lie(self):
        log.warning("HOSTILE: negating the average of %s", self.plan.label)
        return -(await honest(self))

    allreduce.SpanReduction._combine = lie


def erring_reducer() -> None:
    from typing import AsyncIterator

    from hivemind.p2p import P2PContext

    from peer.net.round.reducer import AllReduceServicer
    from peer.proto import allreduce_pb2 as pb

    async def err(self, requests, context):
        log.warning("HOSTILE: answering a part from %s with an error", context.remote_id)
        yield pb.ReduceResponse(status=pb.ReduceResponse.Status.REJECTED, error="busy")

    # (hivemind reads the message types from the annotations, as objects: this module's are strings)
    err.__annotations__ = {"requests": AsyncIterator[pb.ReduceRequest], "context": P2PContext,
                           "return": AsyncIterator[pb.ReduceResponse]}
    AllReduceServicer.rpc_reduce = err


def two_faced_reducer() -> None:
    from peer.net.round import reducer
    from peer.net.round.reduction import decode_piece, encode_pieces
    from peer.net.trust.span_proofs import span_digest
    from peer.proto import allreduce_pb2 as pb

    honest = reducer.AllReduceServicer._send_average

    class OtherFace:  # the reduction as one member sees it: its result is another average
        def __init__(self, red, result):
            self._red, self.result = red, result

        def __getattr__(self, name):
            return getattr(self._red, name)

    async def two_faced(self, red, member, requests, deadline, timing):
        responses = await asyncio.shield(red.result)
        if member % 2 == 0 or not responses or responses[0].status != pb.ReduceResponse.Status.OK:
            async for response in honest(self, red, member, requests, deadline, timing):
                yield response
            return
        average, filled = torch.empty(red.length), 0
        for msg in responses:
            filled += decode_piece(red.plan.codec, msg.piece, msg.offset, filled, average)
        other = [pb.ReduceResponse(status=pb.ReduceResponse.Status.OK, offset=offset, piece=piece)
                 for offset, piece in encode_pieces(red.plan.codec, average * 1.02, red.chunk_elems)]
        other[0].contributors.extend(responses[0].contributors)
        other[0].total_weight = responses[0].total_weight
        gid, j = red.plan.group_id, red.plan.my_index  # (signed as the honest one is: a valid second version)
        other[0].signature = self.signer.sign(gid, j, span_digest(gid, j, other))
        log.warning("HOSTILE: sending member %d of %s another average", member, red.plan.label)
        result = asyncio.get_running_loop().create_future()
        result.set_result(other)
        async for response in honest(self, OtherFace(red, result), member, requests, deadline, timing):
            yield response

    reducer.AllReduceServicer._send_average = two_faced


def round_breaker() -> None:
    from peer.net.round import allreduce

    send = allreduce._remote_span

    async def huge_part(p2p, plan, j, values, *args, **kwargs):
        log.warning("HOSTILE: sending a x1e30 part to reducer %d of %s", j, plan.label)
        return await send(p2p, plan, j, values * 1e30, *args, **kwargs)

    async def never(self):
        log.warning("HOSTILE: never answering as the reducer of %s", self.plan.label)
        await asyncio.sleep(3600)

    allreduce._remote_span = huge_part
    allreduce.SpanReduction._finalize = never


def _forge_published_state(ahead: int = 0) -> None:
    """What this peer publishes (and serves) is its state with G negated, under that state's own digest, as of
    ``ahead`` rounds after its own."""
    from peer.net import state_transfer
    from peer.outer.state import digest_of

    publish = state_transfer.StateServicer.publish

    def forged(self, snap):
        G = -snap.G
        log.warning("HOSTILE: publishing a forged state of fragment %d round %d", snap.fragment, snap.round + ahead)
        publish(self, dataclasses.replace(snap, G=G, round=snap.round + ahead, digest=digest_of(G, snap.v), blocks=[]))

    state_transfer.StateServicer.publish = forged


def _rewrite_records(rewrite) -> None:
    """Every progress record this peer stores goes through ``rewrite(record) -> [(subkey, record)]``: the first
    replaces ours; a subkey of the others that names no key is a suffix to ours (signed with our key)."""
    import hivemind

    store = hivemind.DHT.store

    def patched(self, key, value, expiration_time, subkey=None, return_future=False, **kwargs):
        if isinstance(key, str) and key.endswith("_progress") and isinstance(value, dict) and subkey is not None:
            extra = rewrite(value)
            for sub, record in extra[1:]:
                sub = sub if sub.startswith(b"[owner:") else subkey + sub
                store(self, key, record, expiration_time, subkey=sub, return_future=True)
            value = extra[0][1]
        return store(self, key, value, expiration_time, subkey=subkey, return_future=return_future, **kwargs)

    hivemind.DHT.store = patched


def _sign_for(keys) -> None:
    """The DHT signs a record whose subkey names one of ``keys`` (RSAPrivateKey) with that key, as it signs ours:
    an attacker's copy holding many identities. Must run before the DHT process forks."""
    from hivemind.dht.crypto import RSASignatureValidator

    signers = [RSASignatureValidator(key) for key in keys]
    sign = RSASignatureValidator.sign_value

    def patched(self, record):
        for signer in signers:
            if signer.local_public_key in record.subkey:
                return sign(signer, record)
        return sign(self, record)

    RSASignatureValidator.sign_value = patched


def sybil_majority() -> None:
    """Sybils as an attacker who read the source makes them: each its own RSA key, its id that key's hash (the
    records are self-certifying), each record signed with its own key."""
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.net.trust.auth import peer_id_of

    _forge_published_state()
    keys = [RSAPrivateKey() for _ in range(SYBILS)]
    _sign_for(keys)
    ids = [peer_id_of(key.get_public_key()) for key in keys]
    subkeys = [b"[owner:" + key.get_public_key().to_bytes() + b"]" for key in keys]
    log.warning("HOSTILE: %d sybil records: %s", SYBILS, ", ".join(i[-8:] for i in ids))
    _rewrite_records(lambda rec: [(None, rec)] + [(sub, {**rec, "peer_id": pid}) for sub, pid in zip(subkeys, ids)])


def shadowing() -> None:
    """Issue 28's shadowing: the forged state and a far step, published in records under the honest peers' own
    ids (signed with this peer's key: nothing else can sign them)."""
    from peer.net.trust import progress

    _forge_published_state()
    seen: set[str] = set()
    live = progress.LiveView.live

    def watch(self, local_now):
        found = live(self, local_now)
        seen.update(found)
        return found

    progress.LiveView.live = watch

    def shadow(rec):
        others = sorted(seen - {rec["peer_id"]})
        if others:
            log.warning("HOSTILE: %d records under the ids of %s", len(others), ", ".join(i[-8:] for i in others))
        return [(None, rec)] + [(f"shadow{i}".encode(), {**_ahead(rec, rounds=True), "peer_id": pid})
                                for i, pid in enumerate(others)]

    _rewrite_records(shadow)


def _ahead(rec: dict, *, rounds: bool) -> dict:
    """``rec`` claiming 10^6 steps and 1,000 rounds more (its per-fragment ``rounds`` too if ``rounds``: else they
    come from a published state that is ahead already), not seeking, with no past."""
    more = {"rounds": [r + 1000 for r in rec["rounds"]]} if rounds else {}
    return {**rec, "step": rec["step"] + 10**6, "round": rec["round"] + 1000, "seeking": [], "past": [], **more}


def far_ahead() -> None:
    _forge_published_state()
    _rewrite_records(lambda rec: [(b"", _ahead(rec, rounds=True))])


def served_ahead() -> None:
    """``far_ahead`` that serves what its record claims: the forged state under round + 1,000 and its digest."""
    _forge_published_state(ahead=1000)
    _rewrite_records(lambda rec: [(b"", _ahead(rec, rounds=False))])


def forged_donor() -> None:
    from peer.net import state_transfer

    serve = state_transfer.StateServicer._serve

    async def forged(self, request):
        log.warning("HOSTILE: serving a forged state of fragment %d", request.fragment)
        async for chunk in serve(self, request):
            if chunk.g:
                g = torch.frombuffer(bytearray(chunk.g), dtype=torch.float32)
                chunk.g = (-g).numpy().astype("<f4").tobytes()
            yield chunk

    state_transfer.StateServicer._serve = forged


def _argv_value(flag: str) -> str:
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else ""


def stream_hog() -> None:
    """Starts the hog in a thread of its own once the swarm has started (it reads whom the swarm's daemon is
    connected to)."""
    import threading

    from peer.net import swarm

    start = swarm.Swarm.start

    def started(self, *args, **kwargs):
        start(self, *args, **kwargs)
        threading.Thread(target=asyncio.run, args=(_hog(self),), name="hostile-hog", daemon=True).start()

    swarm.Swarm.start = started


async def _hog(sw) -> None:
    import resource

    from hivemind.p2p import P2P

    from peer.net.round.reducer import AllReduceServicer
    from peer.net.state_transfer import StateServicer

    handles = [AllReduceServicer._get_handle_name(None, "rpc_reduce"),
               StateServicer._get_handle_name(None, "rpc_download")]
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    maddr = _argv_value("--host-maddrs") or "/ip4/127.0.0.1/tcp/0"
    maddr = "/".join(maddr.split("/")[:3]) + "/tcp/0"  # this host's address, a port of each daemon's own
    hogs = await asyncio.gather(*[P2P.create(host_maddrs=[maddr]) for _ in range(HOG_IDENTITIES)])
    log.warning("HOSTILE: %d more identities on %s", len(hogs), maddr)
    held: dict[tuple[int, str], list] = {}
    me = str(sw.peer_id)
    while True:
        peers = asyncio.run_coroutine_threadsafe(sw.p2p._client.list_peers(), sw._loop).result(30)
        targets = {str(info.peer_id): info for info in peers if str(info.peer_id) in sw.live_peers()
                   and str(info.peer_id) != me}
        opened = 0
        for i, hog in enumerate(hogs):
            for pid, info in targets.items():
                streams = [(r, w) for r, w in held.get((i, pid), []) if not (w.is_closing() or getattr(r, "_eof", 0))]
                try:
                    if not streams:
                        await asyncio.wait_for(hog._client.connect(info.peer_id, info.addrs), 5)
                    while len(streams) < HOG_STREAMS:
                        _, reader, writer = await asyncio.wait_for(
                            hog._client.stream_open(info.peer_id, [handles[len(streams) % len(handles)]]), 5)
                        streams.append((reader, writer))  # held open, nothing sent
                        opened += 1
                except Exception:  # refused or reset: try again next pass
                    pass
                held[(i, pid)] = streams
        log.warning("HOSTILE: holding %d streams to %d peers (%d new)", sum(map(len, held.values())),
                    len(targets), opened)
        await asyncio.sleep(2.0)


def record_flood() -> None:
    def flood(rec):
        return [(None, rec)] + [(f"flood{i}".encode(), {"pad": "x" * FLOOD_BYTES}) for i in range(FLOOD_RECORDS)]

    log.warning("HOSTILE: %d records of %d bytes at every beat", FLOOD_RECORDS, FLOOD_BYTES)
    _rewrite_records(flood)


def key_fill() -> None:
    """Sybils whose valid records, as large as a record may be, fill the progress key for everyone: honest records
    that grow (or newcomers') find no room there (issue 28's growth under a flood)."""
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.net.trust.auth import peer_id_of

    keys = [RSAPrivateKey() for _ in range(FILL_SYBILS)]
    _sign_for(keys)
    ids = [peer_id_of(key.get_public_key()) for key in keys]
    subkeys = [b"[owner:" + key.get_public_key().to_bytes() + b"]" for key in keys]
    padding = _full_lists()
    log.warning("HOSTILE: %d sybil records with their lists full at every beat", FILL_SYBILS)
    _rewrite_records(lambda rec: [(None, rec)] + [(sub, {**rec, **padding, "peer_id": pid})
                                                  for sub, pid in zip(subkeys, ids)])


def _full_lists() -> dict:
    """A progress record's lists at their bounds, claiming round 2^40 (~47 KB signed)."""
    from peer.net.trust.records import MAX_FRAGMENTS, MAX_PAST

    big, digest = 1 << 40, "f" * 64
    return {"rounds": [big] * MAX_FRAGMENTS, "digests": [digest] * MAX_FRAGMENTS,
            "past": [(big, big, digest)] * MAX_PAST, "seeking": [[big, big]] * 64, "averaging": [[big, big]] * 64}


def host_fill() -> None:
    """``key_fill`` from ``FILL_NODES`` + 1 nodes of this host (see the module docstring): they start once the swarm
    has (this peer's DHT first); every record this peer stores under the progress key, they store ``HOST_FILL_SYBILS``
    large sybil records and ``HOST_FILL_SMALL`` small ones, each node its share in turn."""
    import hivemind
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.net import heartbeat, swarm
    from peer.net.plumbing.dht import create_dht
    from peer.net.trust.auth import peer_id_of
    from peer.net.trust.progress import make_validators

    keys = [RSAPrivateKey() for _ in range(HOST_FILL_SYBILS)]
    _sign_for(keys)  # (before any DHT process forks: the more nodes' too)
    ids = [peer_id_of(key.get_public_key()) for key in keys]
    subkeys = [b"[owner:" + key.get_public_key().to_bytes() + b"]" for key in keys]
    padding, nodes = _full_lists(), []
    start = swarm.Swarm.start

    def started(self, *args, **kwargs):
        start(self, *args, **kwargs)
        maddr = "/".join(self.cfg.host_maddrs[0].split("/")[:3]) + "/tcp/0"  # this host's address
        for _ in range(FILL_NODES):
            nodes.append(create_dht(initial_peers=self.cfg.initial_peers, host_maddrs=[maddr], announce_maddrs=[],
                                    identity_path=None, client_mode=True,
                                    record_validators=make_validators(self.run_key)[0],
                                    startup_timeout=self.cfg.startup_timeout, wait_timeout=self.cfg.dht_timeout))
        log.warning("HOSTILE: %d more DHT nodes on %s; %d large and %d small sybil records at every beat", len(nodes),
                    maddr, HOST_FILL_SYBILS, HOST_FILL_SMALL)

    swarm.Swarm.start = started
    read, last_read = heartbeat.Heartbeat._read, [float("-inf")]

    async def seldom(self):  # (it needs nothing from the others' records but its start)
        if time.monotonic() - last_read[0] >= FILL_READ_PERIOD:
            last_read[0] = time.monotonic()
            await read(self)

    heartbeat.Heartbeat._read = seldom
    store, pending = hivemind.DHT.store, {}

    def patched(self, key, value, expiration_time, subkey=None, return_future=False, **kwargs):
        if isinstance(key, str) and key.endswith("_progress") and isinstance(value, dict) and subkey is not None:
            small = {k: value[k] for k in ("step", "round", "tokens_per_second", "client_mode", "paused", "time")}
            records = [(sub, {**value, **padding, "peer_id": pid}) for sub, pid in zip(subkeys, ids)]
            records += [(subkeys[i % len(keys)] + b"%d" % i, {**small, "peer_id": ids[i % len(keys)]})
                        for i in range(HOST_FILL_SMALL)]
            senders = [self, *nodes]
            for j, node in enumerate(senders):  # (a node still storing the last beat's share skips this one)
                if j not in pending or pending[j].done():
                    pending[j] = node.run_coroutine(functools.partial(
                        _store_all, key=key, records=records[j::len(senders)],
                        expiration_time=get_dht_time() + FILL_TTL), return_future=True)
        return store(self, key, value, expiration_time, subkey=subkey, return_future=return_future, **kwargs)

    hivemind.DHT.store = patched


async def _store_all(_dht, node, key: str, records: list, expiration_time: float) -> None:
    """(In a DHT process) ``records``, [(subkey, value)], under ``key`` in one store: one search for the nearest
    nodes, one request to each (a store a record drowns in the node's queue, and arrives expired)."""
    subkeys, values = zip(*records)
    await node.store_many([key] * len(values), list(values), expiration_time, subkeys=list(subkeys))


def phantom_group() -> None:
    import os

    from hivemind.averaging.group_info import GroupInfo
    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2

    from peer.net.round import matchmaking, round_runner
    from peer.proto import allreduce_pb2 as pb

    form = round_runner.form_group

    async def first(*args, **kwargs):
        return await form(*args, **{**kwargs, "min_matchmaking_time": PHANTOM_SEARCH_S})

    round_runner.form_group = first
    check = matchmaking._Matchmaking._check_reasons_to_reject

    def one_follower(self, request, context):
        refusal = check(self, request, context)
        if refusal is None and self.current_followers:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
        if refusal is None:
            self.target_group_size = 2  # (hivemind assembles once this follower is in)
        return refusal

    matchmaking._Matchmaking._check_reasons_to_reject = one_follower
    assemble = matchmaking._Matchmaking.leader_assemble_group

    async def with_phantoms(self):
        mine = pb.MemberInfo.FromString(self.step_control.data_for_gather)
        phantom = pb.MemberInfo()
        phantom.CopyFrom(mine)
        phantom.client_mode, phantom.expected = True, 1
        mine.expected = 1
        self.step_control.data_for_gather = mine.SerializeToString()
        ids = [PeerID(b"\x00\x24\x08\x01\x12\x20" + os.urandom(32)) for _ in range(PHANTOMS)]
        for pid in ids:
            self.current_followers[pid] = averaging_pb2.JoinRequest(gather=phantom.SerializeToString())
        try:
            group: GroupInfo = await assemble(self)
        finally:
            for pid in ids:
                self.current_followers.pop(pid, None)
        log.warning("HOSTILE: assembled a group of %d with %d phantoms", len(group.peer_ids), PHANTOMS)
        return group

    matchmaking._Matchmaking.leader_assemble_group = with_phantoms


def equivocator() -> None:
    """Two groups of one round, this peer in both: the lead group capped at the quorum, the rest joined as a follower.
    Patches ``round_runner.form_group`` (the lead search, then the follower-only one), ``_Matchmaking``'s refusals
    (the cap) and ``RoundRunner._find_group``/``_reduce`` (when to attack; both groups reduced at once)."""
    import hashlib

    from hivemind.proto import averaging_pb2
    from hivemind.utils import get_dht_time

    from peer.net.policy.agreement import quorum_size
    from peer.net.round import matchmaking, round_runner
    from peer.net.trust import claims
    from peer.outer.rounds import RoundOutcome, RoundStatus
    from peer.proto import allreduce_pb2 as pb

    attacked: set[str] = set()  # round prefixes where we lead a group capped at the quorum
    capped: set[str] = set()  # ... whose lead group assembled at that cap (others were left to meet apart)
    second: dict[str, asyncio.Future] = {}  # prefix -> the follower-only search, started once the lead group formed
    form = round_runner.form_group

    async def follow_only(p2p, dht, first, *, prefix, gather, target_group_size, min_group_size, min_matchmaking_time,
                          request_timeout, timeout, excluded, **_):
        """form_group's search with hivemind's client mode: no declaration, no handler (our lead search registered
        and removed those of this prefix), join requests only, to any leader but the lead group's members."""
        mm = matchmaking._Matchmaking(p2p, hashlib.sha256(prefix.encode()).digest(), dht,
                                      servicer_type=matchmaking.JoinServicer, prefix=prefix,
                                      target_group_size=max(target_group_size, min_group_size),
                                      min_group_size=min_group_size, min_matchmaking_time=min_matchmaking_time,
                                      request_timeout=request_timeout, client_mode=True)
        mm.label, mm.cap = f"{prefix} (second)", mm.target_group_size
        mm.horizon, mm.numel = timeout + min_matchmaking_time, pb.MemberInfo.FromString(gather).numel
        taken = {str(p) for p in first.peer_ids}  # (our own id among them: hivemind skips it anyway)
        keys = matchmaking._RoundKeys(dht, prefix, "", mm.target_group_size)
        keys.excluded = lambda peer: excluded(peer) or peer in taken or peer in mm.declined
        mm.group_key_manager = keys
        now = get_dht_time()  # (the others' group forms within their matchmaking time: no need to wait longer)
        step = matchmaking.RoundStep(scheduled_time=now + min_matchmaking_time,
                                     deadline=now + min(timeout, min_matchmaking_time + 2 * request_timeout),
                                     data_for_gather=gather)
        return await mm.look_for_group(step)

    async def lead_then_follow(p2p, dht, **kwargs):
        prefix = kwargs["prefix"]
        if prefix not in attacked or kwargs.get("client_mode"):
            return await form(p2p, dht, **kwargs)
        try:
            group = await form(p2p, dht, **{**kwargs, "min_matchmaking_time": EQUIVOCATOR_LEAD_S})
        finally:
            attacked.discard(prefix)
        if group is not None and prefix in capped:
            second[prefix] = asyncio.ensure_future(follow_only(p2p, dht, group, **kwargs))
        capped.discard(prefix)
        return group

    round_runner.form_group = lead_then_follow
    check = matchmaking._Matchmaking._check_reasons_to_reject

    def quorum_cap(self, request, context):
        refusal = check(self, request, context)
        if refusal is not None or self.label not in attacked or self.client_mode:
            return refusal
        # the fewest members a group of our declared count needs to apply (every member counts as many: us included)
        quorum = quorum_size(pb.MemberInfo.FromString(self.step_control.data_for_gather).expected, self.min_group_size)
        if len(self.current_followers) + 1 >= quorum:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
        if len(self.current_followers) + 2 >= quorum:  # with this follower: assemble now, the rest meet apart
            self.target_group_size = len(self.current_followers) + 2
            capped.add(self.label)
        return refusal

    matchmaking._Matchmaking._check_reasons_to_reject = quorum_cap
    find, reduce = round_runner.RoundRunner._find_group, round_runner.RoundRunner._reduce

    async def find_two(self, delta, weight, base_round, base):
        sw = self.swarm
        others = [p for p in sw.live_peers() if p != sw.peer_id]
        if not self.levels and len(others) >= 2 and all(sw.roster.partnered(p) for p in others):
            attacked.add(round_runner.round_prefix(sw.run_key, self.fragment, self.round))  # (everyone counts us)
        return await find(self, delta, weight, base_round, base)

    async def reduce_both(self, group, delta, weight, out):
        follow = second.pop(round_runner.round_prefix(self.swarm.run_key, self.fragment, self.round), None)
        if follow is None:
            return await reduce(self, group, delta, weight, out)
        other = RoundOutcome(self.fragment, self.round, RoundStatus.FAILED, base=out.base)

        async def in_second():
            found = await follow
            if found is None:
                log.warning("equivocator: fragment %d round %d: no second group", self.fragment, self.round)
                return
            log.warning("HOSTILE: in two groups of fragment %d round %d (sizes %d and %d)", self.fragment,
                        self.round, len(group.peer_ids), len(found.peer_ids))
            try:
                await reduce(self, found, delta, weight, other)
            except Exception as e:  # (the lead group's outcome is the round's: this one is only logged)
                other.error = f"{type(e).__name__}: {e}"
            return other

        first, two = await asyncio.gather(reduce(self, group, delta, weight, out), in_second(), return_exceptions=True)
        if isinstance(two, RoundOutcome):
            log.warning("equivocator: fragment %d round %d: lead group %s, second group %s %s", self.fragment,
                        self.round, out.status.value, two.status.value, two.error)
        if isinstance(first, BaseException):
            raise first

    round_runner.RoundRunner._find_group = find_two
    round_runner.RoundRunner._reduce = reduce_both

    def any_claim(self, here, stmt):  # (an honest signer signs one claim per round; this copy signs one per group)
        return pb.MemberClaim(key=self.public, signature=self._key.sign(stmt))

    claims.ClaimSigner.claim = any_claim


ATTACKS = {f.__name__: f for f in (lying_reducer, erring_reducer, two_faced_reducer, round_breaker, sybil_majority,
                                   far_ahead, served_ahead, forged_donor, shadowing, stream_hog, record_flood, key_fill,
                                   host_fill, phantom_group, equivocator)}


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ATTACKS:
        print(f"usage: hostile_peer.py {{{','.join(ATTACKS)}}} run [flags]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ATTACKS[sys.argv[1]]()
    from peer.cli.swarm_peer import main as peer_main

    return peer_main(sys.argv[2:])


if __name__ == "__main__":
    raise SystemExit(main())
