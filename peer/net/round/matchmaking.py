"""Group formation for one round of one fragment, on top of hivemind's leader-based Matchmaking.

Each round gets its own matchmaking prefix ``{run_key}_f{fragment}_r{round}``: peers only meet
peers of the same run (the run hash covers model, codec, outer settings), fragment and round.
hivemind's Matchmaking handles leader election, join requests and group assembly; we register its
``rpc_join_group`` handler under the round's namespace for the round's duration only.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from typing import AsyncIterator, Callable, Optional

from dataclasses import dataclass, field
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.dht import DHT
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from peer.net.round.group import member_info
from peer.net.view import punctuality
from peer.net.flow.streams import StreamGuard, drain, single_request
from peer.proto import allreduce_pb2 as pb

log = logging.getLogger(__name__)


MAX_DECLINED = 4  # fresh starts of a round's search after declined groups (each leader once); the next decline ends it


class _Matchmaking(Matchmaking):
    """hivemind's Matchmaking with five changes.

    - A join request whose stream the leader closed or reset (a leader that just died, or refused us and
      closed first) is a failed request, as hivemind treats a daemon error, instead of an error that ends the
      whole search (the round then failed at once).
    - ``expected`` (peer ids, see :mod:`peer.net.view.attendance`): as a leader, the group assembles as soon as all
      of them joined (asked at each join request and each poll: :meth:`assemble_if_expected`), not only once
      ``target_group_size`` did (which stays the cap on the group's size). So a
      live peer that does not come (crashed, hanging, a made-up id) costs a round nothing once it is no longer
      expected, while a peer that comes anyway before then is still taken. hivemind assembles a group right
      after it accepts a follower that brings it to ``target_group_size``: for the follower that completes the
      expected set, the size that triggers is lowered to the group it makes.
    - A join request that waited for our lock until its follower likely gave up is refused (see :meth:`join`),
      and so is one whose expiration is absurd (:meth:`_sane_expiration`) or whose member info the group plan
      would leave out (:func:`~peer.net.round.group.member_info`): it never gets into a group to fail it.
    - ``waits`` (:class:`LeaderWaits`): as a leader, a peer of ``expected`` stops being waited for once its
      allowance ran out past the moment most of them joined (:func:`~peer.net.view.punctuality.waits`); what it
      waited for each is noted there for the round's lesson.
    - As a follower, a group that ``acceptable`` refuses (not ours by our own count: a hostile leader's made-up
      members, :func:`~peer.net.round.group.holds_our_count`) is declined before any part is sent, and the search
      starts afresh without that leader (:meth:`follower_assemble_group`).
    """

    expected: Callable[[], Optional[frozenset]] = staticmethod(lambda: None)  # set per instance by form_group
    acceptable: Callable[[GroupInfo], bool] = staticmethod(lambda group: True)  # set per instance by form_group
    label: str = ""  # the round's prefix, for the log (set by form_group)
    cap: int = 0
    horizon: float = 0.0  # the longest a follower of this round searches (s), set by form_group
    numel: int = 0  # the fragment's size, from our own member info (set by form_group)
    waits: Optional[LeaderWaits] = None  # set per instance by form_group (None: wait for every expected peer)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._opened: dict[int, float] = {}  # id(P2PContext) -> when its join stream opened (see join)
        self._joined: dict[str, float] = {str(self.peer_id): time.monotonic()}  # as a leader: who joined when
        self._let_go: set[str] = set()  # expected peers we stopped waiting for (logged once)
        self.declined: set[str] = set()  # leaders whose groups we declined this round (never asked again)

    def _wanted(self, joining: Optional[str] = None) -> Optional[frozenset]:
        """Whose arrival assembles our group now: :attr:`expected`, less the peers :attr:`waits` no longer waits
        for (``joining``: a follower being accepted, counted in)."""
        wanted = self.expected()
        if wanted is None or self.waits is None:
            return wanted
        now = time.monotonic()
        here = [str(self.peer_id), *(str(p) for p in self.current_followers), *([joining] if joining else [])]
        joined = {peer: self._joined.setdefault(peer, now) for peer in here}
        still, waited = punctuality.waits(wanted, joined, now, self.min_group_size, self.waits.allowance,
                                          str(self.peer_id))
        if waited is not None:
            self.waits.waited = waited
        for peer in wanted - still - self._let_go:
            log.info("%s: no longer waiting for %s: %.1f s past the quorum, its allowance is spent (by earlier "
                     "waits for it, or for strangers: peer/net/view/punctuality.py)", self.label, peer,
                     waited[peer] if waited else 0.0)
            self._let_go.add(peer)
        return still

    async def join(self, request: averaging_pb2.JoinRequest, context: P2PContext,
                   opened: float) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's ``rpc_join_group`` for a request whose stream opened at ``opened`` (``time.monotonic()``).

        A request that waited for the leader's lock longer than half of ``request_timeout`` (the follower waits
        that long for our answer) is refused: its follower has likely given up. Accepted, it would be listed in
        our group while it searches elsewhere, and the group would wait out ``part_timeout`` for its part. This
        can happen when two peers ask each other at once: each holds its lock while it waits for the other's
        answer, both time out, and the first to take its lock back would accept the other. (Phantom members have
        a second cause, dropped messages: see the hold in :meth:`JoinServicer.rpc_join_group`.)
        """
        self._opened[id(context)] = opened
        try:
            async for message in self.rpc_join_group(request, context):
                yield message
        finally:
            self._opened.pop(id(context), None)

    def _check_reasons_to_reject(self, request, context):
        self.target_group_size = self.cap  # the cap, whatever the last request lowered it to
        refusal = super()._check_reasons_to_reject(request, context)
        waited = time.monotonic() - self._opened.get(id(context), time.monotonic())
        if refusal is None and waited > self.request_timeout / 2:
            log.debug("join request of %s refused: it waited %.1f s for us", context.remote_id, waited)
            refusal = averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)
        if refusal is None and not self._sane_expiration(request.expiration):
            log.debug("join request of %s refused: expiration %r", context.remote_id, request.expiration)
            refusal = averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_EXPIRATION_TIME)
        if refusal is None and (why := member_info(request.gather, self.numel)[1]):
            log.debug("join request of %s refused: %s", context.remote_id, why)
            refusal = averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        wanted = self._wanted(str(context.remote_id)) if refusal is None else None
        if wanted is not None:
            here = {str(self.peer_id), str(context.remote_id), *(str(p) for p in self.current_followers)}
            if wanted <= here:
                self.target_group_size = len(self.current_followers) + 2  # with this follower: assemble now
        return refusal

    async def assemble_if_expected(self) -> None:
        """As a leader, assembles the group now if everyone :attr:`expected` says (asked again: a peer expected at
        the last join request may have paused or left since) has joined, as the join request that completes that
        set would have. Nothing while we follow a leader, before anyone joined, or once assembled."""
        if self.client_mode or self.current_leader is not None or not self.current_followers \
                or not self.is_looking_for_group or self.assembled_group.done():
            return
        async with self.lock_request_join_group:
            wanted = self._wanted()
            here = {str(self.peer_id), *(str(p) for p in self.current_followers)}
            if (wanted is not None and wanted <= here and self.current_leader is None and self.current_followers
                    and self.is_looking_for_group and not self.assembled_group.done()):
                log.debug("assembling: every expected peer joined (%d of them)", len(here))
                await self.leader_assemble_group()

    def _sane_expiration(self, expiration: float) -> bool:
        """A follower declares when its search ends: not before now and not after the longest search of this
        round, each give or take the clock skew hivemind tolerates between peers. (hivemind reads 0.0 as
        "never"; 1e300 would hold our group open as long.)"""
        now, skew = get_dht_time(), MAX_DHT_TIME_DISCREPANCY_SECONDS
        return math.isfinite(expiration) and now - skew <= expiration <= now + self.horizon + skew

    async def follower_assemble_group(self, leader, msg: averaging_pb2.MessageFromLeader) -> Optional[GroupInfo]:
        """hivemind's, for a group that :attr:`acceptable` takes. Another is declined (it does not get our part):
        the search ends with :class:`Declined`, for :func:`form_group` to search afresh without that leader. Going
        on in the same search cost the honest group a ``matchmaking_time``: the leaders that asked us to join them
        while we followed the hostile one were told we follow it, and hivemind asks a peer once per declaration,
        while we, declared earlier than them, wait to be asked (we lead, by hivemind's order) until ours expires."""
        try:
            group = GroupInfo(msg.group_id, tuple(PeerID(p) for p in msg.ordered_peer_ids), tuple(msg.gathered))
        except Exception as e:  # (malformed: hivemind's own checks and the group plan refuse it)
            log.debug("group from %s unreadable: %s: %s", leader, type(e).__name__, e)
            return await super().follower_assemble_group(leader, msg)
        if len(group.peer_ids) == len(group.gathered) and not self.acceptable(group):
            log.info("%s: declined the group of %d that %s assembled: not ours by our own count", self.label,
                     len(group.peer_ids), leader)
            self.declined.add(str(leader))
            if not self.assembled_group.done():
                self.assembled_group.set_exception(Declined(str(leader)))
            return None
        return await super().follower_assemble_group(leader, msg)

    async def _request_join_group(self, leader):
        try:
            return await super()._request_join_group(leader)
        except ConnectionError as e:
            log.debug("join request to %s failed: %s: %s", leader, type(e).__name__, e)
            return None


class Declined(Exception):
    """Our search ended: we declined the group the named leader assembled (see
    :meth:`_Matchmaking.follower_assemble_group`)."""


class JoinServicer(ServicerBase):
    """Forwards join requests of one round to that round's Matchmaking instance, except those of peers
    ``excluded`` says this peer no longer works with (see :mod:`peer.net.trust.exclusion`), within the bounds of
    ``guard`` (streams per remote peer; the request within ``request_timeout``, the whole exchange within
    ``stream_timeout``: see :mod:`peer.net.flow.streams`)."""

    def __init__(self, matchmaking: _Matchmaking, *, guard: StreamGuard, request_timeout: float,
                 stream_timeout: float, excluded: Callable[[str], bool] = lambda peer: False):
        self.matchmaking = matchmaking
        self.excluded = excluded
        self.guard = guard
        self.request_timeout, self.stream_timeout = request_timeout, stream_timeout

    async def rpc_join_group(self, requests: AsyncIterator[averaging_pb2.JoinRequest],
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        opened = time.monotonic()
        refuse = averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        with self.guard.admit(str(context.remote_id), self.stream_timeout) as refusal:
            if refusal or self.excluded(str(context.remote_id)):
                await drain(requests)
                yield refuse
                return
            try:
                request = await single_request(requests, self.request_timeout)
            except (asyncio.TimeoutError, StopAsyncIteration, ValueError):
                yield refuse
                return
            async for message in self.matchmaking.join(request, context, opened):
                yield message
            # Hold the stream until the follower closes it (hivemind then cancels this handler), for at most
            # request_timeout: closing first can drop our last messages in the daemons. A leader that accepted a
            # follower and at once assembled wrote ACCEPTED, BEGIN_ALLREDUCE and its close within a millisecond,
            # and the follower read an empty stream: it never learned of the group that listed it.
            await asyncio.sleep(self.request_timeout)


@dataclass
class LeaderWaits:
    """How long a round we lead waits for whom (:mod:`peer.net.view.punctuality`): ``allowance(peer)`` is read,
    ``waited`` written by the round's search only (its last :func:`~peer.net.view.punctuality.waits`; empty while
    no quorum of the expected peers joined us)."""

    allowance: Callable[[str], float]
    waited: dict[str, float] = field(default_factory=dict)


@dataclass
class RoundStep:
    """The part of hivemind's StepControl that Matchmaking reads. (StepControl itself expects an
    averager process to attach trigger futures, and complains when garbage-collected without.)"""

    scheduled_time: float
    deadline: float
    data_for_gather: bytes

    def get_timeout(self) -> float:
        return max(0.0, self.deadline - get_dht_time())


class _RoundKeys(GroupKeyManager):
    """hivemind's group key manager for one round's prefix, with two changes.

    - Withdrawing our declaration ("no longer looking for a group") is not awaited. Matchmaking withdraws it
      before it hands the assembled group back, and a DHT store waits for every replica: while one DHT node
      is unreachable that takes up to 2 x dht_timeout, so followers learned of their group seconds after the
      leader and missed its first all-reduce messages. The withdrawal only spares latecomers a join request
      we would refuse anyway; it finishes (bounded by the DHT's own timeouts) in a task owned by the event
      loop, which the Swarm cancels at shutdown.
    - The key is never updated when a group assembles: one prefix serves one round, with no group bits.
      hivemind's update draws ``group_size`` of ``target_group_size`` buckets and raised ValueError in a
      follower whose target (its count of live peers) was smaller than the group a leader assembled, as
      happens while peers' views differ (a peer back from an outage is seen by some before others).
    """

    _pending: set = set()  # strong references: the event loop keeps only weak ones to tasks
    excluded: Callable[[str], bool] = staticmethod(lambda peer: False)  # set per instance by form_group

    async def get_averagers(self, group_key, only_active):
        """The potential leaders of this round, without the peers we excluded."""
        found = await super().get_averagers(group_key, only_active)
        return [(peer, expiration) for peer, expiration in found if not self.excluded(str(peer))]

    async def declare_averager(self, group_key, peer_id, expiration_time, looking_for_group=True):
        declare = super().declare_averager(group_key, peer_id, expiration_time, looking_for_group=looking_for_group)
        if looking_for_group:
            return await declare
        task = asyncio.ensure_future(declare)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return True

    async def update_key_on_group_assembled(self, group_info: GroupInfo) -> None:
        return None


def round_prefix(run_key: str, fragment: int, round_: int) -> str:
    return f"{run_key}_f{fragment}_r{round_}"


class GaveUp(Exception):
    """Matchmaking stopped early because ``give_up`` said why (the message); ``status`` is the round status
    the caller reports (e.g. ``behind``: the swarm applied the round without us)."""

    def __init__(self, reason: str, status: str):
        super().__init__(reason)
        self.status = status


async def form_group(p2p: P2P, dht: DHT, *, prefix: str, gather: bytes, target_group_size: int,
                     min_group_size: int, min_matchmaking_time: float, request_timeout: float,
                     client_mode: bool, timeout: float, give_up: Callable[[], Optional[GaveUp]] = lambda: None,
                     keep_waiting: Callable[[], bool] = lambda: False, patience: float = 0.0,
                     poll: float = 1.0, excluded: Callable[[str], bool] = lambda peer: False,
                     guard: StreamGuard, expected: Callable[[], Optional[frozenset[str]]] = lambda: None,
                     acceptable: Callable[[GroupInfo], bool] = lambda group: True,
                     waits: Optional[LeaderWaits] = None) -> Optional[GroupInfo]:
    """Finds a group for the round named by ``prefix``; None if none formed in time.

    ``gather`` (this peer's serialized MemberInfo) reaches every member of the group. The group
    assembles as soon as ``target_group_size`` peers joined, or after ``min_matchmaking_time`` with
    at least ``min_group_size``. The search lasts ``timeout`` s, and longer while ``keep_waiting()`` is
    true (a live peer is on its way to this round, see :func:`peer.net.policy.consensus.laggards`): until ``timeout`` s
    after it last was, and at most ``patience`` s past ``timeout``. ``give_up`` and ``keep_waiting`` are
    asked every ``poll`` s while no group has formed; a :class:`GaveUp` from ``give_up`` (e.g. the swarm
    already applied this round, so no one will come) ends the search: it is raised. Peers for which
    ``excluded`` is true are neither followed as leaders nor accepted as followers. ``guard``: this peer's
    bound on streams per remote peer (see :mod:`peer.net.flow.streams`). ``expected()``, asked at each join request
    (peer ids, ours included, or None; see :func:`peer.net.view.attendance.early_assembly`): as a leader, assemble as
    soon as all of them joined, within the cap of ``target_group_size``; asked again every ``poll`` s (a peer that
    paused or left is no longer expected: its wait ends then, not at ``min_matchmaking_time``). A group that a leader
    assembled for us is joined only if ``acceptable(group)``; else the search starts afresh without that leader
    (at most ``MAX_DECLINED`` times; the next decline ends it with None). ``waits``: as a leader, how long an
    expected peer is waited for past the moment most of them joined (None: as long as the search assembles, see
    :class:`LeaderWaits`). Must run in the event loop that owns ``p2p``.
    """
    schema_hash = hashlib.sha256(prefix.encode()).digest()
    mm = _Matchmaking(p2p, schema_hash, dht, servicer_type=JoinServicer, prefix=prefix,
                      target_group_size=max(target_group_size, min_group_size), min_group_size=min_group_size,
                      min_matchmaking_time=min_matchmaking_time, request_timeout=request_timeout,
                      client_mode=client_mode)
    mm.expected, mm.acceptable, mm.cap, mm.label, mm.waits = expected, acceptable, mm.target_group_size, prefix, waits
    mm.horizon, mm.numel = timeout + patience + min_matchmaking_time, pb.MemberInfo.FromString(gather).numel
    keys = _RoundKeys(dht, prefix, "", mm.target_group_size)
    keys.excluded = lambda peer: excluded(peer) or peer in mm.declined
    mm.group_key_manager = keys
    servicer = JoinServicer(mm, guard=guard, request_timeout=request_timeout,
                            stream_timeout=timeout + patience + min_matchmaking_time, excluded=excluded)
    await servicer.add_p2p_handlers(p2p, namespace=prefix)

    def search_until(deadline: float) -> asyncio.Future:
        now = get_dht_time()
        step = RoundStep(scheduled_time=now + min_matchmaking_time, deadline=deadline, data_for_gather=gather)
        return asyncio.ensure_future(mm.look_for_group(step))

    start = get_dht_time()
    patience_end, last_laggard = start + timeout + patience, None
    search = search_until(start + timeout)
    try:
        while True:
            finished = (await asyncio.wait({search}, timeout=poll))[0]
            if finished and isinstance(search.exception(), Declined):
                if len(mm.declined) > MAX_DECLINED:
                    return None
                # afresh: a new declaration, which the leaders that asked us while we followed that one ask again
                search = search_until(start + timeout)
                continue
            if finished and search.result() is not None:
                return search.result()
            if not finished and (stop := give_up()):
                raise stop
            if not finished:
                await mm.assemble_if_expected()
            if patience > 0 and keep_waiting():
                last_laggard = get_dht_time()
            if not finished:
                continue
            # No group by the deadline. Search on while a peer was on its way within the last `timeout` s.
            deadline = min(patience_end, last_laggard + timeout) if last_laggard is not None else 0.0
            if deadline <= get_dht_time() + poll:
                return None
            search = search_until(deadline)
    finally:  # given up or cancelled: hivemind's look_for_group handles it (a leader sends its followers away)
        if not search.done():
            search.cancel()
            await asyncio.gather(search, return_exceptions=True)
        await servicer.remove_p2p_handlers(p2p, namespace=prefix)
