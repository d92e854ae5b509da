"""Hostile wire input, fuzzed: every RPC handler and the DHT record validator take arbitrary messages.

Each handler is driven directly (no daemons: thousands of examples in seconds) with what a hostile peer can
send: malformed and truncated protobufs, huge declared sizes and offsets, non-finite weights and values,
wrong codecs, length mismatches, streams that end early or never send anything. Each must answer with a
rejection or a correct result within its deadline, never raise, and allocate nothing sized by the sender
before checking it (the only tensors allocated are sized by our own plan). The examples each test runs are
its ``max_examples``; docs/benchmarks.md "Hostile wire input" lists the counts.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time

import pytest
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import dht_nodes
from peer.net.round.reducer import AllReduceServicer
from peer.net.round.reduction import SpanReduction
from peer.net.trust.auth import PassChecker
from peer.net.trust.revocations import revocation_key
from peer.net.trust.exclusion import Offence
from peer.net.round.group import PROTOCOL_VERSION, GroupPlan
from peer.net.flow.streams import StreamGuard
from peer.net.round.matchmaking import JoinServicer
from peer.net.trust.progress import make_validators, progress_key
from peer.net.trust.records import ProgressRecord
from peer.net.state_transfer import ServedState, StateServicer
from peer.outer.codec import get_codec
from peer.outer.state import digest_of
from peer.proto import allreduce_pb2 as pb
from peer.proto import codec_pb2, state_pb2

pytestmark = pytest.mark.timeout(600)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NUMEL = 512
BASE = "0" * 32  # a declared base digest (peer/net/policy/agreement.py): every member the same
HANDLER_DEADLINE = 10.0  # every handler call below must end within this (its own deadlines are ~1 s)

ME, MEMBER, STRANGER = (PeerID(b"\x00\x24" + bytes([i]) * 36) for i in (1, 2, 3))
CODEC = get_codec("e3m0")


def _context(remote: PeerID, name: str = "fuzz") -> P2PContext:
    return P2PContext(handle_name=name, local_id=ME, remote_id=remote)


async def _stream(messages, *, then_hang: bool = False):
    for m in messages:
        yield m
    if then_hang:  # a peer that stops sending and never closes its side
        await asyncio.Event().wait()


async def _drive(gen, deadline: float = HANDLER_DEADLINE) -> list:
    """All responses of a handler, within ``deadline`` seconds (a hang is a failure, not a timeout to wait out)."""
    async def collect():
        return [r async for r in gen]
    return await asyncio.wait_for(collect(), timeout=deadline)


# ---- strategies: what a hostile peer can put on the wire ----------------------------------------------------
weights = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1.0, 1e308, -1.0, 0.0]))
big_ints = st.one_of(st.integers(0, 4 * NUMEL), st.integers(0, (1 << 64) - 1))
pieces = st.builds(
    codec_pb2.EncodedTensor,
    codec=st.sampled_from(["e3m0", "fp32", "fp8", "bf16", "", "pickle"]),
    codec_version=st.integers(0, (1 << 32) - 1), numel=big_ints, data=st.binary(max_size=2048),
    scales=st.binary(max_size=256), block_size=st.sampled_from([0, 1, 64, 1 << 31]),
    shape=st.lists(st.integers(0, (1 << 64) - 1), max_size=3), scalar=st.booleans())


# ---- rpc_reduce ---------------------------------------------------------------------------------------------
NOTHING_SEEN = [pb.SpanSeen(), pb.SpanSeen()]  # what a reducer with no member side sends after its average


def _plan(group_id: bytes) -> GroupPlan:
    info = pb.MemberInfo(protocol_version=PROTOCOL_VERSION, base=BASE, weight=1.0, numel=NUMEL,
                         span_key=bytes(32)).SerializeToString()
    return GroupPlan.from_group(GroupInfo(group_id, (ME, MEMBER), (info, info)), ME, CODEC, NUMEL, "fuzz")


reduce_requests = st.lists(st.builds(
    pb.ReduceRequest, group_id=st.one_of(st.just(b"G" * 20), st.binary(max_size=40)),
    span_index=st.one_of(st.just(0), st.integers(0, (1 << 32) - 1)), weight=weights,
    offset=big_ints, piece=pieces), max_size=4)


@FUZZ
@given(requests=reduce_requests, sender=st.sampled_from([MEMBER, STRANGER]), hang=st.booleans(),
       honest_prefix=st.integers(0, 2))
def test_rpc_reduce_rejects_or_answers_any_stream(requests, sender, hang, honest_prefix):
    """Any request stream (a valid start of a part, then arbitrary messages) gets a rejection or, for a
    complete valid part, the average, within the part deadline; the reduction still finishes."""
    async def main():
        guard = StreamGuard(per_peer=4, total=16)
        servicer = AllReduceServicer(registration_timeout=0.05, part_timeout=0.1, stream_timeout=5.0, guard=guard)
        red = SpanReduction(_plan(b"G" * 20), 0.1, 128, servicer.excluded)
        red.publish_seen(NOTHING_SEEN)  # (as our member side does: here there is none)
        servicer.register(red)
        start, end = red.plan.spans[0]
        values = torch.randn(end - start)
        red.add(0, 1.0, torch.randn(end - start))  # our own part: the reduction waits only for the member's
        honest = []
        for k in range(honest_prefix):  # a real member's first pieces, then the fuzzed ones
            lo, hi = k * 128, min((k + 1) * 128, end - start)
            if lo < hi:
                honest.append(pb.ReduceRequest(offset=lo, piece=CODEC.encode_flat(values[lo:hi])))
        if honest:
            honest[0].group_id, honest[0].span_index, honest[0].weight = b"G" * 20, 0, 1.0
        responses = await _drive(servicer.rpc_reduce(_stream(honest + requests, then_hang=hang), _context(sender)))
        assert all(isinstance(r, pb.ReduceResponse) for r in responses)
        assert responses, "every stream gets an answer"
        for r in responses:
            if r.status == pb.ReduceResponse.Status.OK:
                assert sender == MEMBER
        if sender == MEMBER and not requests and honest_prefix * 128 >= end - start:  # a whole valid part
            assert responses[0].status == pb.ReduceResponse.Status.OK, responses[0]
        await asyncio.wait_for(asyncio.shield(red.result), timeout=HANDLER_DEADLINE)
        assert guard.open_total == 0
        return responses

    asyncio.run(main())  # (a fresh loop per example; no daemons to reap)


def test_one_peer_cannot_fill_the_reducers_waiting_slots():
    """Streams naming unknown groups wait for the group's registration: one remote peer holds at most its
    per-peer share of them (before: 64 such streams left honest members told "unknown group")."""
    async def main():
        guard = StreamGuard(per_peer=4, total=64)
        servicer = AllReduceServicer(registration_timeout=1.0, part_timeout=1.0, stream_timeout=5.0, guard=guard)
        bogus = [asyncio.ensure_future(_drive(servicer.rpc_reduce(
            _stream([pb.ReduceRequest(group_id=os.urandom(20), weight=1.0)]), _context(STRANGER))))
            for _ in range(100)]
        await asyncio.sleep(0)  # (lets them start: no synchronization is needed for what is asserted next)
        for _ in range(200):
            if sum(task.done() for task in bogus) >= 96:
                break
            await asyncio.sleep(0.01)
        assert guard.open[str(STRANGER)] <= 4 and len(servicer._waiters) <= 4
        refused = [r for task in bogus if task.done() for r in task.result()]
        assert len(refused) >= 96 and all("too many open streams" in r.error for r in refused)
        red = SpanReduction(_plan(b"H" * 20), 1.0, 128, servicer.excluded)
        red.publish_seen(NOTHING_SEEN)  # (as our member side does: here there is none)
        servicer.register(red)
        start, end = red.plan.spans[0]
        part = pb.ReduceRequest(group_id=b"H" * 20, span_index=0, weight=1.0, offset=0,
                                piece=CODEC.encode_flat(torch.ones(end - start)))
        honest = await _drive(servicer.rpc_reduce(_stream([part]), _context(MEMBER)))
        assert honest[0].status == pb.ReduceResponse.Status.OK
        await asyncio.gather(*bogus)

    asyncio.run(main())  # (a fresh loop per example; no daemons to reap)


def test_a_members_bad_parts_are_verdicts_of_the_reduction_not_ledger_writes():
    """A member's wrong span index and an undecodable piece are offences the reduction keeps as verdicts (the
    round hands them to the swarm, the ledger's one writer); an excluded member is refused without one."""
    async def main():
        guard = StreamGuard(per_peer=4, total=16)
        excluded = {str(STRANGER)}
        servicer = AllReduceServicer(registration_timeout=0.05, part_timeout=0.5, stream_timeout=5.0, guard=guard,
                                     excluded=excluded)
        red = SpanReduction(_plan(b"V" * 20), 0.5, 128, servicer.excluded)
        red.publish_seen(NOTHING_SEEN)  # (as our member side does: here there is none)
        servicer.register(red)
        start, end = red.plan.spans[0]
        wrong_span = pb.ReduceRequest(group_id=b"V" * 20, span_index=1, weight=1.0, offset=0,
                                      piece=CODEC.encode_flat(torch.ones(end - start)))
        garbage = pb.ReduceRequest(group_id=b"V" * 20, span_index=0, weight=1.0, offset=0,
                                   piece=codec_pb2.EncodedTensor(codec=CODEC.name, codec_version=CODEC.version,
                                                                 numel=end - start, data=b"\x00"))
        for request in (wrong_span, garbage):
            answer = await _drive(servicer.rpc_reduce(_stream([request]), _context(MEMBER)))
            assert answer[0].status == pb.ReduceResponse.Status.REJECTED, answer
        return red.verdicts

    verdicts = asyncio.run(main())
    assert [(v.peer, v.offence) for v in verdicts] == [(str(MEMBER), Offence.BAD_PART)] * 2, verdicts
    assert verdicts[0].why.startswith("fuzz: span 1")  # (the plan's label, then what)


# ---- rpc_download -------------------------------------------------------------------------------------------
state_requests = st.lists(st.builds(state_pb2.StateRequest, fragment=st.integers(0, (1 << 32) - 1),
                                    round=st.one_of(st.integers(0, 4), st.integers(0, (1 << 64) - 1))), max_size=3)


@FUZZ
@given(requests=state_requests, hang=st.booleans())
def test_rpc_download_answers_any_request_within_its_deadline(requests, hang):
    async def main():
        guard = StreamGuard(per_peer=4, total=16)
        servicer = StateServicer(100, guard=guard, request_timeout=0.2, stream_timeout=5.0)
        G, v = torch.randn(NUMEL), torch.randn(NUMEL)
        servicer.publish(ServedState(0, 3, 30, G, v, digest_of(G, v)))
        responses = await _drive(servicer.rpc_download(_stream(requests, then_hang=hang), _context(STRANGER)))
        assert responses and all(isinstance(r, state_pb2.StateChunk) for r in responses)
        # one request and the end of the stream (what every honest requester sends), for a state we hold
        if len(requests) == 1 and not hang and requests[0].fragment == 0 and requests[0].round in (0, 3):
            assert sum(len(r.g) for r in responses) == 4 * NUMEL
        else:  # no request, several, a stream left open, or a state we do not hold
            assert len(responses) == 1 and responses[0].error
        assert guard.open_total == 0

    asyncio.run(main())  # (a fresh loop per example; no daemons to reap)


# ---- rpc_join_group -----------------------------------------------------------------------------------------
class _Loop:
    """One event loop in a thread for the examples that need a real DHT node and Matchmaking."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def leader(tmp_path_factory):
    """Our Matchmaking (hivemind's, as form_group makes it) of a real DHT node, looking for a group (target size
    unreachable, so the fuzzed requests meet a leader in the middle of a search), behind our JoinServicer."""
    with dht_nodes(1, tmp_path_factory.mktemp("join")) as (dht,):
        runner = _Loop()

        async def start():
            p2p = await dht.replicate_p2p()
            from peer.net.round.matchmaking import RoundStep, _Matchmaking
            mm = _Matchmaking(p2p, b"S" * 32, dht, servicer_type=JoinServicer, prefix="fuzz", target_group_size=1000,
                              min_group_size=2, min_matchmaking_time=3600.0, request_timeout=1.0, client_mode=False)
            mm.cap, mm.horizon, mm.numel = mm.target_group_size, 3600.0, 10
            from hivemind.utils import get_dht_time
            search = asyncio.ensure_future(mm.look_for_group(RoundStep(get_dht_time() + 3600, get_dht_time() + 3600,
                                                                        b"")))
            for _ in range(100):  # look_for_group sets its state within the first await
                if mm.is_looking_for_group:
                    break
                await asyncio.sleep(0.01)
            return mm, search

        mm, search = runner.run(start())
        yield runner, mm
        runner.loop.call_soon_threadsafe(search.cancel)
        runner.stop()


join_requests = st.lists(st.builds(
    averaging_pb2.JoinRequest, schema_hash=st.one_of(st.just(b"S" * 32), st.binary(max_size=64)),
    expiration=st.floats(allow_nan=True, allow_infinity=True), gather=st.binary(max_size=256),
    client_mode=st.booleans(), group_key=st.text(max_size=40)), max_size=2)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(requests=join_requests, hang=st.booleans())
def test_rpc_join_group_answers_any_request(leader, requests, hang):
    """Join requests of any content from a stranger: a reply (a refusal, or hivemind's answer) and the end of
    the stream within the request deadline plus the leader's answer, never a hang or an exception."""
    runner, mm = leader
    guard = StreamGuard(per_peer=4, total=16)
    servicer = JoinServicer(mm, guard=guard, request_timeout=0.2, stream_timeout=2.0)

    async def one():
        gen = servicer.rpc_join_group(_stream(requests, then_hang=hang), _context(STRANGER))
        replies = []
        try:  # an accepted follower waits for the group: the stream deadline (2 s) ends it
            async for r in gen:
                replies.append(r)
        except asyncio.CancelledError:
            pass
        return replies

    async def in_task():
        return await asyncio.wait_for(asyncio.ensure_future(one()), timeout=HANDLER_DEADLINE)

    t0 = time.monotonic()
    replies = runner.run(in_task())
    assert time.monotonic() - t0 < HANDLER_DEADLINE
    assert replies and all(isinstance(r, averaging_pb2.MessageFromLeader) for r in replies)
    if not requests:
        assert replies == [averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)]
    assert guard.open_total == 0


def test_rpc_join_group_refuses_a_peer_without_a_pass_in_an_authenticated_run(leader):
    """The join handler's entry point of an authenticated run (the reduce and download handlers': in
    tests/test_auth.py, over real daemons): a well-formed join request from a peer whose pass we do not hold is
    refused before hivemind's matchmaking sees it, and counted."""
    runner, mm = leader
    admitted = {str(MEMBER)}
    guard = StreamGuard(per_peer=4, total=16, admitted=admitted.__contains__)
    servicer = JoinServicer(mm, guard=guard, request_timeout=0.2, stream_timeout=2.0)
    request = averaging_pb2.JoinRequest(schema_hash=b"S" * 32, expiration=time.time() + 60, client_mode=False)

    async def ask(who: PeerID) -> list:
        async def replies():
            return [r async for r in servicer.rpc_join_group(_stream([request]), _context(who))]
        try:
            return await asyncio.wait_for(asyncio.ensure_future(replies()), timeout=HANDLER_DEADLINE)
        except asyncio.TimeoutError:  # an accepted follower waits for its group: not a refusal
            return ["waited"]

    assert runner.run(ask(STRANGER)) == [averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)]
    assert guard.unadmitted == 1
    runner.run(ask(MEMBER))
    assert guard.unadmitted == 1  # the admitted member went on to hivemind's matchmaking


def test_a_join_request_with_an_absurd_expiration_or_member_info_is_refused(leader):
    """What would get a member into a group only to fail it is refused at the join: an expiration of 0.0
    (hivemind reads it as never), NaN or far past the round's longest search, a member info the group plan
    would leave out (empty, another size). The same request with sane fields gets hivemind's own answer."""
    runner, mm = leader
    servicer = JoinServicer(mm, guard=StreamGuard(per_peer=4, total=16), request_timeout=0.2, stream_timeout=2.0)
    good = pb.MemberInfo(protocol_version=PROTOCOL_VERSION, weight=1.0, numel=10, base="a" * 32,
                         span_key=bytes(32)).SerializeToString()
    other_size = pb.MemberInfo(protocol_version=PROTOCOL_VERSION, weight=1.0, numel=11,
                               base="a" * 32).SerializeToString()

    def ask(expiration: float, gather: bytes) -> list:
        request = averaging_pb2.JoinRequest(schema_hash=b"S" * 32, expiration=expiration, gather=gather,
                                            group_key=mm.group_key_manager.current_key)

        async def replies():
            return [r async for r in servicer.rpc_join_group(_stream([request]), _context(STRANGER))]

        async def bounded():
            try:
                return await asyncio.wait_for(asyncio.ensure_future(replies()), timeout=HANDLER_DEADLINE)
            except asyncio.TimeoutError:  # an accepted follower waits for its group
                return ["waited"]
        return runner.run(bounded())

    bad_time = [averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)]
    violation = [averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)]
    sane = get_dht_time() + mm.horizon  # (not before the leader's own expiration: hivemind's rule)
    assert ask(0.0, good) == bad_time
    assert ask(float("nan"), good) == violation  # (hivemind refuses it itself)
    assert ask(1e300, good) == bad_time
    assert ask(sane + 3600, good) == bad_time
    assert ask(sane, b"") == violation
    assert ask(sane, other_size) == violation
    assert ask(sane, good) not in (bad_time, violation)


# ---- DHT record validator -----------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=20), inner, max_size=8),
    max_leaves=30)
record_fields = st.fixed_dictionaries({}, optional={
    "peer_id": st.one_of(st.text(max_size=60), st.just("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")),
    "step": st.integers(-(1 << 70), 1 << 70), "round": st.integers(-(1 << 70), 1 << 70),
    "rounds": st.lists(st.integers(-(1 << 70), 1 << 70), max_size=5),
    "digests": st.lists(st.text(max_size=70), max_size=5), "seeking": json_values,
    "tokens_per_second": st.floats(), "client_mode": json_values, "time": st.floats(),
    "pass_line": st.one_of(st.text(max_size=80), st.just("swarmloco-pass:" + "A" * 5000))})
MSGPACK_NONE = b"\xc0"


def _pack(value) -> bytes:
    """msgpack bytes of ``value`` as a DHT record's value is stored (ints beyond 64 bits: a reserved byte)."""
    try:
        return DHTProtocol.serializer.dumps(value)
    except (OverflowError, TypeError, ValueError):
        return b"\xc1"


# packed values: records from the strategies above, and revocation lists
packed = st.one_of(record_fields, st.fixed_dictionaries({"revoked": st.lists(st.text(max_size=50), max_size=3),
                                                         "issued": st.floats(), "signature": st.binary(max_size=400)})
                   ).map(_pack)


@settings(max_examples=1000, deadline=None)
@given(value=st.one_of(json_values, record_fields))
def test_record_parsing_accepts_only_well_formed_records(value):
    try:
        rec = ProgressRecord.from_wire(value)
    except ValueError:
        return
    assert 0 <= rec.step <= 1 << 40 and all(0 <= r <= 1 << 40 for r in rec.rounds)
    assert math.isfinite(rec.time) and math.isfinite(rec.tokens_per_second)


AUTHORITY_PUB = RSAPrivateKey().get_public_key().to_bytes()


@settings(max_examples=500, deadline=None)
@given(key=st.binary(max_size=64), subkey=st.binary(max_size=600), value=st.one_of(st.binary(max_size=600), packed),
       expiration=st.floats(allow_nan=True, allow_infinity=True), which=st.sampled_from(["any", "progress", "revoked"]),
       authenticated=st.booleans())
def test_record_validators_never_raise(key, subkey, value, expiration, which, authenticated):
    """hivemind calls each validator on every record a peer stores or reads: arbitrary bytes are refused
    (False), never an exception; in an authenticated run too (records must carry a pass, revocation lists the
    authority's signature)."""
    from hivemind.dht.routing import DHTID

    checker = PassChecker(AUTHORITY_PUB) if authenticated else None
    validators, _ = make_validators("fuzzrun", checker=checker)
    if which != "any":
        source = progress_key("fuzzrun") if which == "progress" else revocation_key(AUTHORITY_PUB)
        key = DHTID.generate(source=source).to_bytes()
    record = DHTRecord(key=key, subkey=subkey, value=value, expiration_time=expiration)
    for validator in validators:
        assert validator.validate(record) in (True, False)
    if authenticated and which == "progress" and value not in (MSGPACK_NONE,):
        assert not validators[0].validate(record)  # no valid pass can come out of these bytes

