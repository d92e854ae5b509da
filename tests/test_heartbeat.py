"""The heartbeat's reads (peer/net/heartbeat.py) against a fake DHT and daemon: whom it greets, and when a joiner's
view has settled (every live peer greeted, the daemon's connections listed after)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hivemind.utils import ValueWithExpiration

import peer.net.heartbeat as heartbeat
from peer.config import SwarmConfig
from peer.net.flow.streams import HostBook
from peer.net.trust.auth import Admission
from peer.net.trust.exclusion import Exclusions
from peer.net.trust.records import ProgressRecord
from peer.net.view.roster import MAX_ARRIVALS, Roster

ME = "M" * 46


def rec(pid: str) -> ProgressRecord:
    return ProgressRecord(peer_id=pid, step=1, round=0, tokens_per_second=1.0, client_mode=False, time=1.0)


class FakeDaemon:
    """The DHT's answer (every record in ``records``) and the daemon's connections (the peers dialed so far, each
    on its own loopback port)."""

    def __init__(self, records: list[ProgressRecord]):
        self.records = records
        self.connected: list[str] = []

    async def get(self, key, latest: bool, return_future: bool):
        return ValueWithExpiration({r.peer_id.encode(): ValueWithExpiration(r.model_dump(), 1e12)
                                    for r in self.records}, 1e12)

    async def list_peers(self):
        return [SimpleNamespace(peer_id=pid, addrs=[f"/ip4/127.0.0.1/tcp/{4000 + i}"])
                for i, pid in enumerate(self.connected)]


def test_a_joiner_is_settled_once_every_live_peer_was_greeted_and_listed(monkeypatch):
    """A peer that met no one acts on the records of the peers its daemon lists a connection with; a read greets at
    most MAX_ARRIVALS arrivals, so with more peers live and not listed yet the view settles a read later, once the
    last were greeted and listed (the trainer waits for it before the first catch-up: an attacker that dials every
    peer it sees is otherwise the one anchored record at a joiner's first decisions)."""
    others = [f"P{i:045d}".replace("0", "z") for i in range(MAX_ARRIVALS + 4)]
    daemon = FakeDaemon([rec(ME), *(rec(p) for p in others)])

    async def connect(p2p, peer_id, maddrs):
        if peer_id.to_base58() not in daemon.connected:
            daemon.connected.append(peer_id.to_base58())

    monkeypatch.setattr(heartbeat, "connect", connect)
    roster = Roster(ttl=60.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True, hosts=HostBook())
    beat = heartbeat.Heartbeat(SwarmConfig(), dht=daemon, p2p=daemon, run_key="run", subkey=b"me", peer_id=ME,
                               roster=roster, admission=Admission(None), access=None, record=lambda: rec(ME),
                               initial_peers={})

    daemon.connected.append(others[-1])  # (a peer our DHT node already talks to: listed, nothing to wait for)
    asyncio.run(beat._read())
    assert beat.wait_first_read(0) and not beat.wait_settled(0)
    assert len(daemon.connected) >= MAX_ARRIVALS and sorted(roster.ungreeted(ME)) == sorted(set(others) - set(
        daemon.connected)) and roster.ungreeted(ME)
    assert set(roster.vouched_peers()) == {ME, *daemon.connected}  # (listed before the read ended)
    asyncio.run(beat._read())
    assert beat.wait_settled(0) and sorted(daemon.connected) == sorted(others)
    assert set(roster.vouched_peers()) == {ME, *others}
    # one more comes later: not settled while its greeting is under way, settled once it is listed
    late = "Q" * 46
    daemon.records.append(rec(late))

    async def read_with_a_slow_greeting() -> bool:
        dialing, answer = asyncio.Event(), asyncio.Event()

        async def slow(p2p, peer_id, maddrs):
            dialing.set()
            await answer.wait()
            await connect(p2p, peer_id, maddrs)

        monkeypatch.setattr(heartbeat, "connect", slow)
        read = asyncio.ensure_future(beat._read())
        await dialing.wait()
        during = beat.wait_settled(0)
        answer.set()
        await read
        return during

    assert asyncio.run(read_with_a_slow_greeting()) is False
    assert beat.wait_settled(0) and late in daemon.connected and late in roster.vouched_peers()


def test_a_read_that_greets_no_one_settles_at_once(monkeypatch):
    """Alone (no other live record): nothing to greet, settled at the first read."""
    daemon = FakeDaemon([rec(ME)])
    roster = Roster(ttl=60.0, exclusions=Exclusions(threshold=1), admitted=lambda pid: True, hosts=HostBook())
    beat = heartbeat.Heartbeat(SwarmConfig(), dht=daemon, p2p=daemon, run_key="run", subkey=b"me", peer_id=ME,
                               roster=roster, admission=Admission(None), access=None, record=lambda: rec(ME),
                               initial_peers={})

    async def reconnect(*args):
        return 0

    monkeypatch.setattr(heartbeat, "reconnect", reconnect)
    asyncio.run(beat._read())
    assert beat.wait_settled(0)


def test_a_stop_ends_the_joins_wait_for_greetings_and_the_wait_is_sliced():
    """The trainer waits for the settled view within ``start_timeout`` (120 s by default), a crowd of identities
    taking a read per eight: a Ctrl-C in that wait must end it at the next slice, not at the deadline."""
    import threading

    from peer.run.trainer import Trainer

    stop = threading.Event()
    asked: list[float] = []

    class Swarm:
        def wait_first_read(self, timeout: float) -> bool:
            return True

        def live_count(self) -> int:
            return 3

        def wait_settled(self, timeout: float) -> bool:  # never settles; a stop comes while the first slice waits
            asked.append(timeout)
            if len(asked) == 2:
                stop.set()
            return False

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = SimpleNamespace(swarm=SwarmConfig(min_peers=1, start_timeout=120.0))
    trainer.swarm, trainer.stop = Swarm(), SimpleNamespace(event=stop)
    shown: list[str] = []
    trainer.figures = SimpleNamespace(show=shown.append)
    trainer._wait_for_peers()
    assert asked == [0.0, min(1.0, SwarmConfig().progress_period)] and stop.is_set()
    assert shown and shown[0].startswith("greeting the visible peers")
