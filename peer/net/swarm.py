"""This peer's networking: the DHT process, one asyncio event-loop thread, RPC servicers, rounds.

:class:`Swarm` is the owner of every background task of the networking layer: :meth:`Swarm.start`
starts the DHT (a forked process, so it must be created before CUDA is initialized) and the
``swarm-net`` thread that runs our P2P replica, the all-reduce servicer and every round;
:meth:`Swarm.shutdown` stops all of them. The training loop talks to it only through blocking or
future-returning methods; no torch state is shared except the tensors handed to :meth:`run_round`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Callable, Mapping, Optional

import torch
from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPublicKey

from peer.net.round.reducer import AllReduceServicer
from peer.net.trust.auth import Admission, RunAccess, encode_pass, identity_key
from peer.net.trust.claims import ClaimSigner, Entry
from peer.net.flow.bandwidth import Bandwidth
from peer.net.view.activity import RoundActivity
from peer.net.policy.agreement import quorum_peers
from peer.net.view.attendance import Absent, Attendance
from peer.net.view.punctuality import Punctuality
from peer.net.plumbing.dial_back import DialBackServicer, nat_verdict
from peer.net.policy.consensus import live_count
from peer.outer.aggregate import AggregationRule
from peer.outer.codec import codec_key, get_codec
from peer.config import SwarmConfig
from peer.net.plumbing.addresses import peers_of
from peer.net.plumbing.dht import create_dht
from peer.net.trust.exclusion import Exclusions, Offence, PeerVerdict
from peer.net.flow.links import DeadlinePolicy, LinkMeter, slow_donors_last, state_deadline
from peer.net.flow.streams import HostBook, StreamGuard, cap_frame_size, frame_limit_for
from peer.outer.rounds import RoundOutcome
from peer.net.trust.progress import dht_security, progress_key
from peer.net.view.roster import Roster
from peer.net.round.round_runner import Lesson, RoundRunner
from peer.net.trust.records import ProgressRecord
from peer.net.heartbeat import Heartbeat
from peer.net.witness import Witness
from peer.net.our_record import OurRecord
from peer.net.state_transfer import DownloadError, ServedState, StateServicer, download
from peer.proto import allreduce_pb2 as pb
from peer.util import Stopped, result_or_stop

log = logging.getLogger(__name__)


def swarm_key(run_id: str, run_hash: str, codec: str) -> str:
    """The prefix of every DHT key of a run (progress records, matchmaking, state): run id, run hash and the wire
    codec's name and version, so peers of different runs or codecs never meet."""
    return f"{run_id}_{run_hash}_{codec_key(codec)}"


class Swarm:
    """Owns the DHT, the ``swarm-net`` event loop thread, the P2P replica and the servicers.

    Must be started before CUDA is initialized (the DHT forks). Every method except :meth:`start`
    must be called after :meth:`start` and before :meth:`shutdown`.

    Who writes its state: what our record publishes (``ours``, :class:`~peer.net.our_record.OurRecord`, and the
    snapshots it serves) the training thread; the roster, the attendance, the rounds in flight, ``client_mode`` and
    the host listing ``swarm-net`` (the heartbeat, the rounds and :meth:`learn`); ``_dht`` and ``_p2p``
    :meth:`start` and :meth:`shutdown`, on the thread that owns the swarm.
    """

    def __init__(self, cfg: SwarmConfig, *, run_key: str, codec, identity_path: str,
                 rule: Optional[AggregationRule] = None, access: Optional[RunAccess] = None,
                 bandwidth: Optional[Bandwidth] = None, on_exclude: Optional[Callable[[str, str], None]] = None,
                 claimed_path: Optional[str] = None):
        """``rule``: how our spans are combined when we reduce (the run's; by default the robust rule).
        ``access``: our pass in an authenticated run (None: an open run, anyone may take part).
        ``bandwidth``: the owner's caps on our all-reduce and state-transfer streams (None: uncapped).
        ``on_exclude(peer, why)``: called once per peer we exclude (:class:`Exclusions`; on ``swarm-net``).
        ``claimed_path``: where the rounds we signed a claim for are kept across restarts (None: in memory only)."""
        self.bandwidth = bandwidth or Bandwidth()
        self.claimed_path = claimed_path
        self.cfg = cfg
        self.codec = get_codec(codec)  # a name or a configured codec instance
        self.rule = rule or AggregationRule()
        self.run_key = swarm_key(cfg.run_id, run_key, self.codec.name)
        self.identity_path = identity_path
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-net", daemon=True)
        self._dht: Optional[DHT] = None  # set by start(), cleared by shutdown()
        self._p2p: Optional[P2P] = None
        # peers we no longer work with (and why): written by learn() only, read by the rounds and the servicers
        self.exclusions = Exclusions(threshold=cfg.exclude_after, on_exclude=on_exclude)
        self.access = access
        self.admission = Admission(access.checker if access else None)  # who may take part (authenticated runs)
        if access is not None:
            self.admission.learn(access.token)
        # which host each remote peer connects from (its streams count in its host's budget); listed by the daemon
        self.hosts = HostBook()
        # who we see: live records, vouched speeds, partners, known peers (peer/net/view/roster.py; fed by the
        # heartbeat)
        self.roster = Roster(ttl=cfg.progress_ttl, exclusions=self.exclusions, admitted=self.admission.admitted,
                             hosts=self.hosts)
        self.guard = StreamGuard(per_peer=cfg.max_streams_per_peer, total=cfg.max_streams,  # all our handlers
                                 admitted=self.admission.admitted, per_host=cfg.max_streams_per_host,
                                 hosts=self.hosts, resolve=self._list_hosts, partner=self.roster.partnered,
                                 reserved=int(cfg.max_streams * cfg.partner_share))
        self.policy = DeadlinePolicy.of(cfg)  # how long rounds and state downloads may take (peer/net/flow/links.py)
        self.uplink = LinkMeter()  # our uplink as our reducers timed our parts, declared to every group
        self.downlink = LinkMeter()  # our downlink as averages and state came in (sizes our state downloads)
        # a member's part and stream may take as long as the longest deadlines a group can give them
        longest, longest_state = ((cfg.deadline_max, cfg.deadline_max) if self.policy.measured
                                  else (cfg.allreduce_timeout, cfg.state_timeout))
        longest_part = longest - (cfg.allreduce_timeout - cfg.part_timeout)
        self.servicer = AllReduceServicer(registration_timeout=cfg.request_timeout, part_timeout=longest_part,
                                          stream_timeout=longest + cfg.part_timeout + 2 * cfg.request_timeout,
                                          guard=self.guard, excluded=self.exclusions, bandwidth=self.bandwidth)
        self.state_servicer = StateServicer(max(1, cfg.chunk_bytes // 8), guard=self.guard,
                                            request_timeout=cfg.request_timeout,
                                            stream_timeout=longest_state + cfg.request_timeout,
                                            upload=self.bandwidth.upload, max_uploads=cfg.max_state_uploads)
        # answers `swarm-peer doctor`'s "can others dial me?" (bounded: peer/net/plumbing/dial_back.py)
        self.dial_back = DialBackServicer(guard=self.guard, timeout=cfg.request_timeout,
                                          request_timeout=cfg.request_timeout)
        self._subkey = b""
        self.ours = OurRecord(self.state_servicer)  # what our record says (set by the training thread)
        self._claims: Optional[ClaimSigner] = None  # signs our claims with our identity's key (set by start())
        self._witness: Optional[Witness] = None  # publishes them, reads everyone's (set by start())
        self._claims_horizon = cfg.matchmaking_timeout + cfg.matchmaking_patience + longest + cfg.witness_timeout
        self.client_mode = cfg.client_mode  # or set at start when nobody outside can dial us (_check_reachability)
        self.attendance = Attendance()  # whom our rounds wait for (peer/net/view/attendance.py; swarm-net only)
        # how long a group we lead waits for each of them (peer/net/view/punctuality.py; swarm-net only)
        self.punctuality = Punctuality(per_round=min(cfg.straggler_wait, cfg.matchmaking_time),
                                       cap=cfg.matchmaking_time)
        self._heartbeat: Optional[Heartbeat] = None  # our record out, everyone's in (set by start())
        # rounds in flight, by (fragment, round): added and removed by run_round on swarm-net, read by activity()
        self._rounds: dict[tuple[int, int], RoundRunner] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, stop: Optional[threading.Event] = None) -> None:
        """Starts the DHT and the networking thread. Raises :class:`~peer.errors.JoinError` if no initial peer
        answered within ``join_timeout`` (retried with backoff; ``stop`` ends the retries)."""
        access = self.access
        key = identity_key(self.identity_path)
        validators, self._subkey, auth = dht_security(self.run_key, access, key)
        self._claims = ClaimSigner(key, self.run_key, self.claimed_path)
        cap_frame_size(frame_limit_for(self.cfg.chunk_bytes))  # before the DHT forks: its streams are bounded too
        self._dht = create_dht(initial_peers=self.cfg.initial_peers, host_maddrs=self.cfg.host_maddrs,
                              announce_maddrs=self.cfg.announce_maddrs, identity_path=self.identity_path,
                              client_mode=self.cfg.client_mode, nat_port_map=self.cfg.nat_port_map,
                              relay_via=self.cfg.relay_via, relay_service=self.cfg.relay_service,
                              record_validators=validators, startup_timeout=self.cfg.startup_timeout,
                              wait_timeout=self.cfg.dht_timeout, join_timeout=self.cfg.join_timeout, stop=stop,
                              **auth)
        self._thread.start()
        self._p2p = self._call(self.dht.replicate_p2p(), self.cfg.startup_timeout)
        self._heartbeat = Heartbeat(self.cfg, dht=self.dht, p2p=self.p2p, run_key=self.run_key, subkey=self._subkey,
                                    peer_id=self.peer_id, roster=self.roster, admission=self.admission,
                                    access=access, record=self._record, observe=self._observe,
                                    initial_peers=peers_of(self.cfg.initial_peers))  # (checked by create_dht)
        self._witness = Witness(self.dht, run_key=self.run_key, subkey=self._subkey, peer_id=self.peer_id,
                                horizon=self._claims_horizon, timeout=self.cfg.witness_timeout)
        if not self.cfg.client_mode:
            self._call(self.servicer.add_p2p_handlers(self.p2p), self.cfg.startup_timeout)
            self._call(self.state_servicer.add_p2p_handlers(self.p2p), self.cfg.startup_timeout)
            self._call(self.dial_back.add_p2p_handlers(self.p2p), self.cfg.startup_timeout)
            if self.cfg.reachability_check and self.cfg.initial_peers and not self.cfg.relay_via:  # relayed: dialable
                asyncio.run_coroutine_threadsafe(self._check_reachability(), self._loop)
        asyncio.run_coroutine_threadsafe(self._heartbeat.run(), self._loop)

    async def _check_reachability(self) -> None:
        """Goes on in client mode if nobody outside can dial us (peer/net/plumbing/dial_back.py); rounds that started
        before the answer keep the mode they started with."""
        try:
            why = await nat_verdict(self.p2p, self.cfg.initial_peers, self.cfg.request_timeout)
        except Exception as e:  # (an initial peer that misbehaves: judged by nothing, as if unknown)
            log.debug("reachability check: %s: %s", type(e).__name__, e)
            return
        if why:
            self.client_mode = True
            log.warning("nobody outside can dial this peer: %s. It goes on in client mode (it still contributes; "
                        "it reduces no span and serves no state); forward the port or pass --client-mode", why)

    def _list_hosts(self) -> None:
        """(swarm-net loop) A stream came from a peer whose host is not known yet: ``hosts`` lists the daemon's
        connections soon."""
        self.hosts.list_soon(self.p2p, self.cfg.request_timeout)

    def shutdown(self) -> None:
        """Stops the event loop thread (the heartbeat first: it would publish our record again), withdraws our
        progress record, so that the others stop waiting for us at once, and stops the DHT. Idempotent."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._cancel_all_and_stop)
            self._thread.join(timeout=10)
        if self._dht is not None:
            try:  # (a record the heartbeat had in flight expires before the withdrawal: the withdrawal wins)
                self._dht.store(progress_key(self.run_key), None, get_dht_time() + self.cfg.progress_ttl,
                                subkey=self._subkey, return_future=True).result(self.cfg.request_timeout)
            except Exception as e:  # leaving is best effort: the record expires on its own
                log.warning("could not withdraw our progress record (the others see us for up to %g s more): "
                            "%s: %s", self.cfg.progress_ttl, type(e).__name__, e)
            self._dht.shutdown()
            self._dht = None

    def _cancel_all_and_stop(self) -> None:
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.call_soon(self._loop.stop)

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def dht(self) -> DHT:
        """The DHT. Must be used after :meth:`start` and before :meth:`shutdown`."""
        if self._dht is None:
            raise RuntimeError("the swarm is not started (or already shut down)")
        return self._dht

    @property
    def p2p(self) -> P2P:
        """Our replica of the DHT's libp2p daemon. Must be used after :meth:`start` and before :meth:`shutdown`."""
        if self._p2p is None:
            raise RuntimeError("the swarm is not started (or already shut down)")
        return self._p2p

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    # ---- progress records ------------------------------------------------------------------
    def _record(self) -> ProgressRecord:
        """Our progress record as of now (the heartbeat publishes it; called on swarm-net)."""
        return self.ours.record(peer_id=self.peer_id, activity=self.activity(), client_mode=self.client_mode,
                                pass_line=encode_pass(self.access.token) if self.access else "",
                                uplink=self.declared_uplink())

    def wait_first_read(self, timeout: float) -> bool:
        """Blocks until the heartbeat has read the others' progress records once (found or not), up to
        ``timeout`` s; False on timeout. Call it before a decision that needs the swarm's view, such as the
        catch-up of a peer that just joined: until then :meth:`live_peers` is empty."""
        return self._heartbeat is not None and self._heartbeat.wait_first_read(timeout)

    def wait_settled(self, timeout: float) -> bool:
        """Blocks until the heartbeat greeted every live peer our daemon did not list, and listed its connections
        after (see :meth:`Heartbeat.wait_settled`), up to ``timeout`` s; False on timeout. Call it before the first
        decision that acts on the anchored records of a peer that met no one (the joiner's catch-up)."""
        return self._heartbeat is not None and self._heartbeat.wait_settled(timeout)

    @property
    def pass_ended(self) -> Optional[str]:
        """Authenticated runs: :meth:`RunAccess.why_ended` (checked every step); None in an open run."""
        return None if self.access is None else self.access.why_ended(self.peer_id, self.admission)

    def refused(self, peer: object) -> bool:
        """Whether we work with ``peer`` in no group: we excluded it, or it holds no valid pass (authenticated
        runs)."""
        return str(peer) in self.exclusions or not self.admission.admitted(str(peer))

    def live_peers(self) -> dict[str, ProgressRecord]:
        """:meth:`Roster.live_peers`; never blocks: the training thread calls it at every launch."""
        return self.roster.live_peers()

    def paused_peers(self) -> list[str]:
        """Ids of the peers of this run whose live records say they are paused (not in :meth:`live_peers`)."""
        return self.roster.paused_peers(self.peer_id)

    def vouched_peers(self) -> dict[str, ProgressRecord]:
        """The live records the consensus rules may act on: :meth:`Roster.vouched_peers`."""
        return self.roster.vouched_peers()

    def partner_votes(self, records: dict[str, ProgressRecord]) -> dict[str, ProgressRecord]:
        """Of ``records``: our partners', one per host (:meth:`Roster.partner_votes`)."""
        return self.roster.partner_votes(records)

    def live_count(self) -> int:
        """Live peers of this run, ourselves always included."""
        return live_count(self.live_peers(), self.peer_id)

    # ---- state transfer --------------------------------------------------------------------
    def download_state(self, fragment: int, donors: list[str], *, round_: int, numel: int, digest: str,
                       stop: Optional[threading.Event] = None) -> ServedState:
        """Blocking: the fragment's state ``digest`` in parts from up to ``state_donors`` donors at once
        (:func:`~peer.net.state_transfer.download`); DownloadError if they run out (donor ids come from other
        peers' records: one that does not parse is skipped) or ``stop`` is set (the download is cancelled)."""
        ids = []
        for d in donors:
            if not self.admission.admitted(d):
                log.warning("fragment %d: skipping state donor %s: no valid pass for this run", fragment, d[-8:])
                continue
            try:
                ids.append(PeerID.from_base58(d))
            except Exception:  # (base58 and multihash errors of several kinds)
                log.warning("fragment %d: skipping state donor %r: not a peer id", fragment, d[:64])
        if not ids:
            raise DownloadError("no valid donor")
        # slow donors last; each gets the time its share takes through the uplink its record declares, or through
        # our downlink's share (peer/net/flow/links.py)
        records, width = self.live_peers(), min(self.cfg.state_donors, len(ids))
        uplinks = {pid: records[str(pid)].upload_bytes_per_second if str(pid) in records else 0.0 for pid in ids}
        ids = slow_donors_last(uplinks)
        downlink = self.downlink.rate(cap=self.bandwidth.rates()[1])
        timeouts = {pid: state_deadline(numel, width, uplinks[pid], self.policy, downlink) for pid in ids}
        coro = download(self.p2p, ids, fragment, round_=round_, numel=numel, digest=digest,
                        timeout_per_donor=timeouts, max_chunk_elems=max(1, self.cfg.chunk_bytes // 4),
                        pacer=self.bandwidth.download, parallel=self.cfg.state_donors, on_sample=self.downlink.observe,
                        on_lie=lambda who, why: self.learn(Lesson((fragment, round_), verdicts=(
                            PeerVerdict(who, f"fragment {fragment}: {why}", Offence.BAD_STATE),))),
                        on_unheld=lambda who: self.learn(Lesson((fragment, round_), unheld=(who,))),
                        on_failed=lambda who: self.learn(Lesson((fragment, round_), failed=(who,))),
                        on_served=lambda who: self.learn(Lesson((fragment, round_), served=(who,))))
        # (donors run side by side, a failed one's part goes to the next: at worst one after the other)
        total = sum(timeouts.values()) + 5
        try:
            return result_or_stop(asyncio.run_coroutine_threadsafe(coro, self._loop), total, stop)
        except concurrent.futures.TimeoutError:
            raise DownloadError(f"no donor delivered within {total:.0f} s") from None
        except Stopped:
            raise DownloadError("cancelled: the peer is stopping") from None

    # ---- rounds ----------------------------------------------------------------------------
    def run_round(self, *, fragment: int, round_: int, delta: torch.Tensor, weight: float,
                  base: "concurrent.futures.Future[tuple[int, str]]", inner_step: int, target_group_size: int,
                  sync_every: Optional[int] = None) -> "concurrent.futures.Future[RoundOutcome]":
        """Starts round ``round_`` of ``fragment`` in the background; the future never raises. ``base`` resolves to
        the (round, digest) of the state the round's average will be applied to (declared to the group).

        ``delta`` (fp32 CPU, the outer gradient) must not be modified until the future is done.
        ``sync_every``: the steps schedule's H (None on the clock schedule). The phase rules of
        :mod:`peer.net.policy.consensus` then apply: if no group formed within matchmaking_timeout, keep looking while a
        live peer's record shows it has not reached ``inner_step`` yet; stop as soon as every live peer has left
        the round without us. On both schedules the search stops once no other peer is live (status ``alone``,
        as at launch). The future completes within matchmaking_timeout
        (+ matchmaking_patience on the steps schedule) + the round's all-reduce deadline (allreduce_timeout, or
        with measured deadlines up to deadline_max) + the claims' exchange (``witness_timeout``) seconds.
        """
        runner = RoundRunner(self, fragment=fragment, round_=round_, inner_step=inner_step,
                             target_group_size=target_group_size, sync_every=sync_every)

        async def tracked() -> RoundOutcome:
            self._rounds[runner.here] = runner
            try:
                return await runner.run(delta, weight, base)
            finally:
                self._rounds.pop(runner.here, None)

        return asyncio.run_coroutine_threadsafe(tracked(), self._loop)

    # ---- what rounds read, and what they taught (round_runner.SwarmView) ----------------------------------------
    async def claim(self, here: tuple[int, int], stmt: bytes) -> Optional[pb.MemberClaim]:
        """Our claim of ``stmt`` (:func:`peer.net.trust.claims.statement`) for round ``here``, signed with our
        identity's key; None if we signed one for that round before (:class:`~peer.net.trust.claims.ClaimSigner`:
        its disk write on a worker thread)."""
        assert self._claims is not None, "Swarm.start() first"
        return await asyncio.get_running_loop().run_in_executor(None, self._claims.claim, here, stmt)

    async def witness(self, here: tuple[int, int], entries: list[Entry], keys: Mapping[str, RSAPublicKey]
                      ) -> Optional[list[Entry]]:
        """:meth:`peer.net.witness.Witness.exchange` for round ``here`` (on ``swarm-net``); any peer what it read
        shows in two groups of one round is excluded (:meth:`~peer.net.witness.Witness.judge`, checked against its
        key in ``keys``, the claims of a group of ours, or its record's; applied by :meth:`learn`)."""
        assert self._witness is not None, "Swarm.start() first"
        read = await self._witness.exchange(entries)
        if read is not None:
            verdicts = await self._witness.judge(read, lambda pid: keys.get(pid) or self.roster.key_of(pid))
            if verdicts:
                self.learn(Lesson(here, verdicts=tuple(verdicts)))
        return read

    def admitted(self, peer: str) -> bool:
        return self.admission.admitted(peer)

    def vouched_speed(self, peer: str, now: float) -> Optional[float]:
        return self.roster.speeds.vouched(peer, now)

    def allowance(self, peer: str) -> float:
        return self.punctuality.allowance(peer, self.roster.partnered)

    def invited(self, here: tuple[int, int]) -> frozenset[str]:
        """Whom round ``here`` waits for now (:meth:`Attendance.expected`, of :meth:`Roster.meetable`: a record no
        daemon answers for is not waited for); the round hands its last answer back in its lesson."""
        return self.attendance.expected(self.roster.meetable(self.live_peers()), self.peer_id,
                                        self.ours.applied_rounds(), self.roster.partnered, here=here)

    def quorum_peers(self, invited: frozenset[str], here: tuple[int, int]) -> frozenset[str]:
        """The peers round ``here`` counts, whose number it declares (agreement.quorum_peers), of the peers it waits
        for (:meth:`invited`) and the live peers our daemon answers for (:meth:`Roster.anchored`)."""
        live = self.live_peers()
        counted = self.attendance.counted(invited, self.peer_id, self.roster.partnered, here[0])
        return quorum_peers(counted, live, self.roster.partnered, self.peer_id, anchored=self.roster.anchored(live))

    def learn(self, lesson: Lesson) -> list[Absent]:
        """Applies what a round or a state download taught (on swarm-net; the one place they change the swarm's
        state): who stayed away (returned), whom we met, verdicts on peers, link samples, donors that advertised a
        state they do not hold or fail to deliver, how long a group we led waited for whom."""
        absent: list[Absent] = []
        if lesson.judge:
            live = self.live_peers()
            if lesson.came is None:
                absent = self.attendance.no_group(invited=lesson.invited, live=live, me=self.peer_id,
                                                  met=self.roster.partnered, fragment=lesson.here[0])
            else:
                absent = self.attendance.record(invited=lesson.invited, live=live, came=lesson.came,
                                                me=self.peer_id, met=self.roster.partnered, fragment=lesson.here[0])
        if lesson.came is not None:
            self.roster.met(set(lesson.came) - {self.peer_id})
        if lesson.waited:
            self.punctuality.settle(dict(lesson.waited), self.roster.partnered, self.live_peers())
        for peer in lesson.unheld:
            self.roster.unheld(peer, lesson.here)
        for peer in lesson.failed:
            self.roster.donor_failed(peer)
        for peer in lesson.served:
            self.roster.donor_served(peer)
        for verdict in lesson.verdicts:
            self.exclusions.apply(verdict)
        if lesson.uplink:
            self.uplink.observe(*lesson.uplink)
        if lesson.downlink:
            self.downlink.observe(*lesson.downlink)
        return absent

    def _observe(self) -> None:
        """After each read of the records (the heartbeat, on swarm-net): what the attendance notes of them."""
        self.attendance.observe(self.live_peers(), self.ours.applied_rounds())

    def declared_uplink(self) -> float:
        """Our uplink in bytes/s as we declare it to groups and in our record: measured, at most the owner's upload
        cap (0: neither known yet)."""
        return self.uplink.rate(cap=self.bandwidth.rates()[0])

    def activity(self) -> list[RoundActivity]:
        """The rounds in flight, by fragment and round (a snapshot; cheap, never blocks)."""
        return [runner.activity for _, runner in sorted(dict(self._rounds).items())]

