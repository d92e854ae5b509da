"""Stream budgets per peer, per host and in all (peer/net/flow/streams.py): pure, in one event loop."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from peer.net.flow.streams import (HOST_LISTING_PERIOD, UNRESOLVED, HostBook, ResponseStream, StreamGuard,
                                   host_key)
from peer.proto import allreduce_pb2 as pb


def test_a_host_is_an_ipv4_address_or_an_ipv6_64_and_relayed_or_loopback_peers_have_none():
    assert host_key(["/ip4/203.0.113.7/tcp/4001"]) == "203.0.113.7"
    assert host_key(["/ip6/2001:db8:1:2:aa::5/tcp/4001"]) == host_key(["/ip6/2001:db8:1:2::9/tcp/1"])
    assert host_key(["/ip6/2001:db8:1:2::9/tcp/1"]) != host_key(["/ip6/2001:db8:1:3::9/tcp/1"])
    assert host_key(["/ip4/198.51.100.1/tcp/1/p2p/QmRelay/p2p-circuit"]) is None
    assert host_key(["/ip4/127.0.0.1/tcp/1"]) is None and host_key(["/ip6/::1/tcp/1"]) is None
    assert host_key([]) is None


def test_fresh_identities_of_one_host_share_its_budget_and_unlisted_ones_share_one():
    """Issue 28's attacker: 34 identities of one host holding streams open filled a peer's 512. Now the peers of
    one host hold at most per_host, before the daemon lists them (they share the unresolved budget) and after."""
    async def run() -> None:
        book, listings = HostBook(), []
        guard = StreamGuard(per_peer=16, total=512, per_host=64, hosts=book, resolve=lambda: listings.append(1))
        attackers = [f"A{i}" for i in range(34)]
        with contextlib.ExitStack() as held:
            def open_all(peers, n):
                return sum(held.enter_context(guard.admit(p, 60)) is None for p in peers for _ in range(n))
            assert open_all(attackers, 16) == 64  # unlisted: one shared budget
            assert listings and book.host("A0") == UNRESOLVED
            book.learn([(p, ["/ip4/203.0.113.7/tcp/4001"]) for p in attackers] +
                       [("honest", ["/ip4/198.51.100.2/tcp/4001"])])
            assert open_all(attackers, 16) == 0  # listed: their host holds 64 already
            assert guard.open_from_host("203.0.113.7") == 64
            assert open_all(["honest"], 16) == 16  # another host is not affected
            assert open_all(["late"], 16) == 16  # a new unlisted peer: the unresolved budget is free again
        assert guard.open_total == 0 and guard.refused == 34 * 16 - 64 + 34 * 16

    asyncio.run(run())


def test_relayed_and_loopback_peers_count_one_by_one():
    async def run() -> None:
        book = HostBook()
        guard = StreamGuard(per_peer=4, total=100, per_host=8, hosts=book)
        peers = [f"R{i}" for i in range(5)]
        book.learn([(p, ["/ip4/198.51.100.1/tcp/1/p2p/QmRelay/p2p-circuit"]) for p in peers])
        with contextlib.ExitStack() as held:
            admitted = sum(held.enter_context(guard.admit(p, 60)) is None for p in peers for _ in range(4))
        assert admitted == 20  # per peer 4, no host budget

    asyncio.run(run())


def test_strangers_from_many_hosts_leave_the_partners_their_reserved_streams():
    """Issue 28: honest partners (peers we averaged with) keep reserved capacity. Strangers of 40 hosts, 16
    streams each, would fill all 512; they get 512 - 128, and a partner still opens its own."""
    async def run() -> None:
        book, partners = HostBook(), {"partner"}
        guard = StreamGuard(per_peer=16, total=512, per_host=64, hosts=book, partner=partners.__contains__,
                            reserved=128)
        strangers = [f"S{i}" for i in range(40)]
        book.learn([(p, [f"/ip4/203.0.113.{i}/tcp/4001"]) for i, p in enumerate(strangers)] +
                   [("partner", ["/ip4/198.51.100.2/tcp/4001"]), ("newcomer", ["/ip4/198.51.100.3/tcp/4001"])])
        with contextlib.ExitStack() as held:
            def open_all(peers, n):
                return sum(held.enter_context(guard.admit(p, 60)) is None for p in peers for _ in range(n))
            assert open_all(strangers, 16) == 512 - 128
            assert open_all(["newcomer"], 1) == 0  # a stranger too: the rest is reserved
            assert open_all(["partner"], 16) == 16
            # strangers are taken in turn: S0..S23 hold 16 each; S30, refused so far, averages with us
            partners.add("S30")
            assert open_all(["S30"], 16) == 16
            assert guard.open_strangers == 512 - 128 and guard.open_total == 512 - 128 + 32
        assert guard.open_total == 0 and guard.open_strangers == 0
        # once the strangers are gone, a newcomer gets in again
        with guard.admit("newcomer", 60) as refusal:
            assert refusal is None

    asyncio.run(run())


def test_the_reserve_must_leave_room_for_strangers():
    with pytest.raises(ValueError, match="reserved"):
        StreamGuard(per_peer=4, total=16, reserved=16)


def test_the_book_lists_the_daemons_connections_once_at_a_time_and_not_more_often_than_its_period():
    class Daemon:  # (hivemind's P2P: list_peers is all the book asks of it)
        def __init__(self) -> None:
            self.calls, self.answer = 0, asyncio.Event()

        async def list_peers(self):
            self.calls += 1
            await self.answer.wait()
            return [type("Info", (), {"peer_id": "A", "addrs": ["/ip4/203.0.113.7/tcp/4001"]})()]

    async def until(cond) -> bool:  # (the listing runs as a task: a few turns of the loop)
        for _ in range(200):
            if cond():
                return True
            await asyncio.sleep(0.005)
        return cond()

    async def run() -> None:
        book, daemon = HostBook(), Daemon()
        for _ in range(3):  # a burst of unlisted peers: one listing
            book.list_soon(daemon, timeout=5)
        assert await until(lambda: daemon.calls == 1) and book.host("A") == UNRESOLVED
        book.list_soon(daemon, timeout=5)  # one still running: none more
        daemon.answer.set()
        assert await until(lambda: book.host("A") == "203.0.113.7")
        book.list_soon(daemon, timeout=5)  # within the period of the last: none
        await asyncio.sleep(HOST_LISTING_PERIOD / 2)
        assert daemon.calls == 1
        await asyncio.sleep(HOST_LISTING_PERIOD / 2)
        book.list_soon(daemon, timeout=5)
        assert await until(lambda: daemon.calls == 2)

    asyncio.run(run())


@pytest.mark.parametrize("end", ["eof", "reset", "broken pipe"])
def test_a_stream_whose_handler_or_connection_closed_ends_the_same_whichever_the_reader_saw(end):
    """The responses of a stream we opened end (StopAsyncIteration) when the handler's side closes, and also when
    the connection breaks first: our writer's failed write to a closed stream ends the reader with
    BrokenPipeError, a reset with ConnectionResetError, by the race of who wrote last. A member that read either
    named a reducer that hung up at once by the error's name instead of "no response"."""

    class Writer:
        closed = False

        def close(self) -> None:
            self.closed = True

    async def quiet():  # (requests that are never written: the test is the reader's)
        await asyncio.Event().wait()
        yield pb.ReduceRequest()

    async def run() -> None:
        reader, writer = asyncio.StreamReader(), Writer()
        reader.feed_data(b"\x00\x00")  # (a cut length prefix: the end comes mid-message)
        if end == "eof":
            reader.feed_eof()
        else:
            reader.set_exception(ConnectionResetError() if end == "reset" else BrokenPipeError(32, "Broken pipe"))
        stream = ResponseStream(reader, writer, quiet(), pb.ReduceResponse, "rpc_reduce")
        try:
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
        finally:
            await stream.aclose()
        assert writer.closed

    asyncio.run(run())
