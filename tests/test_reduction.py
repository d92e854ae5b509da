"""A reducer's span (peer/net/round/reduction.py) alone: its parts are closed before they are combined, and the
combination runs off the event loop that serves the members' streams."""

from __future__ import annotations

import asyncio
import threading

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from helpers import run_async
from peer.net.round import reduction
from peer.net.round.group import PROTOCOL_VERSION, GroupPlan
from peer.net.round.reduction import SpanReduction, decode_piece
from peer.outer.aggregate import aggregate
from peer.outer.codec import get_codec
from peer.proto import allreduce_pb2 as pb

NUMEL = 4096
BASE = "0" * 32
CODEC = get_codec("e3m0")
PEERS = [PeerID(b"\x00\x24" + bytes([i]) * 36) for i in (1, 2, 3)]


def plan_of_three() -> GroupPlan:
    info = pb.MemberInfo(protocol_version=PROTOCOL_VERSION, base=BASE, weight=1.0, numel=NUMEL,
                         span_key=bytes(32)).SerializeToString()
    return GroupPlan.from_group(GroupInfo(b"R" * 20, tuple(PEERS), (info,) * 3), PEERS[0], CODEC, NUMEL, "test")


def test_the_parts_are_combined_off_the_loop_which_keeps_serving_and_a_late_part_is_refused(monkeypatch):
    loop_threads: list[int] = []
    combined_on: list[int] = []
    served_meanwhile = threading.Event()

    def combine_when_the_loop_answered(*args):
        combined_on.append(threading.get_ident())
        # the loop runs a callback while the parts are being combined: it is not blocked by them
        assert served_meanwhile.wait(timeout=30), "the event loop was blocked while the parts were combined"
        return aggregate(*args)

    monkeypatch.setattr(reduction, "aggregate", combine_when_the_loop_answered)

    async def main():
        loop_threads.append(threading.get_ident())
        red = SpanReduction(plan_of_three(), 30.0, 1024)
        start, end = red.plan.spans[0]
        parts = [torch.randn(end - start, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        assert red.add(0, 1.0, parts[0]) and red.add(1, 2.0, parts[1])
        red.give_up_on(2)  # all in: the reduction combines the two parts now
        for _ in range(3000):  # (at most 30 s; each turn yields to the reduction)
            if combined_on:
                break
            await asyncio.sleep(0.01)
        assert combined_on, "the parts were not combined within 30 s of being all in"
        asyncio.get_running_loop().call_soon(served_meanwhile.set)
        assert not red.add(2, 1.0, parts[2]), "a part after the parts were closed must be refused"
        responses = await asyncio.wait_for(red.result, timeout=60)
        return red, parts, responses

    red, parts, responses = run_async(main())
    assert combined_on and combined_on[0] != loop_threads[0]
    assert responses[0].status == pb.ReduceResponse.Status.OK and list(responses[0].contributors) == [0, 1]
    out = torch.empty(len(parts[0]))
    filled = 0
    for msg in responses:
        filled += decode_piece(CODEC, msg.piece, msg.offset, filled, out)
    want = CODEC.decode_flat(CODEC.encode_flat(aggregate(parts[:2], [1.0, 2.0], red.plan.rule).value))
    assert torch.equal(out, want)  # the same bits as the rule and the codec give on the loop's thread


def test_a_client_mode_members_empty_span_closes_at_once_and_warns_of_nothing(caplog):
    """A member in client mode reduces no span (its span is empty): no part comes to it, so its reduction must not
    wait ``part_timeout`` and then log every member of the group as missing, round after round."""
    infos = [pb.MemberInfo(protocol_version=PROTOCOL_VERSION, base=BASE, weight=1.0, numel=NUMEL,
                           client_mode=(i == 0), span_key=bytes(32)).SerializeToString() for i in range(3)]
    plan = GroupPlan.from_group(GroupInfo(b"R" * 20, tuple(PEERS), tuple(infos)), PEERS[0], CODEC, NUMEL, "test")
    assert plan.spans[0][0] == plan.spans[0][1], plan.spans

    async def main():
        red = SpanReduction(plan, 30.0, 1024)
        return red, await asyncio.wait_for(red.result, timeout=5)
    red, responses = run_async(main())
    assert red.closed and [r.status for r in responses] == [pb.ReduceResponse.Status.FAILED]
    assert not [r for r in caplog.records if "without members" in r.getMessage()]
