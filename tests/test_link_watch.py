"""Lost members of a round (peer/net/round/link_watch.py): the listing rule alone, then a real member process killed
with SIGKILL while our stream to it waits for its answer (what a member of a round does while its reducer dies)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import dht_nodes, run_async
from peer.net.round.allreduce import ConnectionLost, _next_unless
from peer.net.round.link_watch import LinkWatch

A, B, C = "A" * 46, "B" * 46, "C" * 46


def test_a_member_is_lost_once_listed_then_missing_from_two_listings_in_a_row():
    async def main():
        watch = LinkWatch(p2p=None, peers=[A, B, C])  # type: ignore[arg-type]  (learn() is fed by hand)
        gone: list[str] = []
        watch.on_lost(gone.append)
        watch.learn({A, B})  # C never listed: never judged (its connection may be through a listing we missed)
        watch.learn({B})
        assert not watch.lost(A).is_set()  # one miss is forgiven: a reconnect in between
        watch.learn({A, B})
        watch.learn({B})
        watch.learn({B})
        assert watch.lost(A).is_set() and gone == [A]
        for _ in range(3):
            watch.learn(set())
        assert gone == [A, B] and not watch.lost(C).is_set()  # (each once)
        assert not watch.lost("D" * 46).is_set()  # a peer not watched is never lost
    run_async(main())


class _ListsThenStops:
    """A daemon whose listing answers at once, and asks the watch to stop just as that answer comes in: in
    Python 3.11 ``asyncio.wait_for`` returns an inner result that is done when its cancellation arrives and so
    swallows the cancellation (fixed in 3.12)."""

    def __init__(self):
        self.watch: LinkWatch | None = None
        self.stopping: asyncio.Task | None = None
        self.calls = 0

    async def list_peers(self):
        self.calls += 1
        if self.stopping is None and self.watch is not None:
            self.stopping = asyncio.ensure_future(self.watch.stop())  # (runs before wait_for sees our answer)
        return []


def test_a_watch_stops_even_when_its_cancellation_arrives_with_a_listing():
    """The round's ``finally`` awaits :meth:`LinkWatch.stop`: a stop lost to that race would hold the round (and
    the training that waits for it) until ``outer.wait_timeout``."""
    async def main():
        daemon = _ListsThenStops()
        watch = daemon.watch = LinkWatch(daemon, [A], period=0.01)  # type: ignore[arg-type]
        watch.start()
        await asyncio.wait_for(asyncio.shield(_stopped(daemon)), timeout=5)
        calls = daemon.calls
        await asyncio.sleep(0.1)
        assert daemon.calls == calls  # nothing lists any more

    async def _stopped(daemon):
        while daemon.stopping is None:
            await asyncio.sleep(0.005)
        await daemon.stopping
    run_async(main())


VICTIM = textwrap.dedent("""
    import asyncio, sys
    from hivemind.proto.dht_pb2 import PingRequest, PingResponse
    from peer.net.plumbing import dht as dht_node
    dht = dht_node.create_dht(initial_peers=sys.argv[2:], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                              identity_path=sys.argv[1], client_mode=False, record_validators=(), startup_timeout=30,
                              wait_timeout=3.0)

    async def main():
        p2p = await dht.replicate_p2p()

        async def never_answers(requests, context):
            async for _ in requests:
                await asyncio.sleep(3600)
            yield PingResponse()

        await p2p.add_protobuf_handler("never", never_answers, PingRequest, stream_input=True, stream_output=True)
        print("ready", p2p.peer_id.to_base58(), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


@pytest.mark.timeout(120)
def test_a_wait_on_a_member_killed_with_sigkill_ends_within_seconds(tmp_path):
    """The daemon drops the connection of a member whose process was killed, but our open stream to it never ends
    (measured: no message and no end within 40 s); with the watch the wait ends a few listings after the kill."""
    from hivemind.p2p import PeerID
    from hivemind.proto.dht_pb2 import PingRequest, PingResponse
    from peer.net.plumbing import dht as dht_node

    with dht_nodes(1, tmp_path) as (node,):
        victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(tmp_path / "victim.id"),
                                   *map(str, dht_node.visible_maddrs(node))],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            line = victim.stdout.readline()  # (bounded by the test's timeout; it exits on its own in an hour)
            assert line.startswith("ready"), line
            victim_id = line.split()[1]

            async def main():
                p2p = await node.replicate_p2p()

                async def requests():
                    yield PingRequest()
                    await asyncio.sleep(3600)

                stream = await p2p.iterate_protobuf_handler(PeerID.from_base58(victim_id), "never", requests(),
                                                            PingResponse)
                watch = LinkWatch(p2p, [victim_id], period=0.5)
                watch.start()
                try:
                    deadline = time.monotonic() + 60
                    while victim_id not in {str(i.peer_id) for i in await p2p.list_peers()}:
                        assert time.monotonic() < deadline, "never connected to the victim"
                        await asyncio.sleep(0.1)
                    os.killpg(victim.pid, signal.SIGKILL)
                    t0 = time.monotonic()
                    gone = asyncio.ensure_future(watch.lost(victim_id).wait())
                    with pytest.raises(ConnectionLost):
                        await _next_unless(stream, time.monotonic() + 45, gone)
                    return time.monotonic() - t0
                finally:
                    await watch.stop()
                    await stream.aclose()

            took = run_async(main())
            assert took < 15, took
        finally:
            if victim.poll() is None:
                os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(timeout=30)
