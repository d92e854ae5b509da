"""The ``swarm`` section of a peer's configuration (:class:`SwarmConfig`): how this peer meets the others. The run's
name and the authority that admits peers, addresses and relays, when rounds form and how long each stage may take,
how spans are sized, what our progress records and state downloads do, and the bounds on what other peers can
make this one hold. Declared and checked as every section is (:mod:`peer.config.sections`): each field with its
default, its help and whether it is local, each value checked as the section is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.fields import MAX_RECORD_TTL, check, setting


@dataclass(kw_only=True)
class SwarmConfig:
    run_id: str = setting("swarmloco", help="Name of the training run; part of every DHT key.")
    initial_peers: list[str] = setting(factory=list, local=True, help="Multiaddrs of bootstrap nodes or peers (from "
            "swarm-bootstrap's paste line).")
    new_swarm: bool = setting(False, local=True, help="Start a new swarm without initial peers (otherwise empty "
            "initial_peers is an error).")
    host_maddrs: list[str] = setting(factory=lambda: ["/ip4/0.0.0.0/tcp/0"], local=True, help="Multiaddrs to listen "
            "on.")
    announce_maddrs: list[str] = setting(factory=list, local=True, help="Multiaddrs other peers should dial (public "
            "address behind port forwarding).")
    identity_path: str = setting("", local=True, help="libp2p private key file (created if missing; stable peer id). "
            "Default: RUN_DIR/identity.key.")
    authority: str = setting("", help="Authenticated run: the run authority's public key (the ssh-rsa line of "
            "swarm-bootstrap authority init); only peers with a pass it signed take part. Empty: an open run that "
            "anyone may join.")
    pass_path: str = setting("", local=True, help="Authenticated run: the file holding this peer's pass (from the "
            "operator, for the line of swarm-peer pass-request). Default: RUN_DIR/pass.txt.")
    client_mode: bool = setting(False, local=True, help="Outbound connections only (behind NAT): the peer "
            "contributes but reduces no span.")
    reachability_check: bool = setting(True, local=True, help="At start, a peer not in client mode that listens "
            "beyond loopback asks an initial peer to dial it back (as swarm-peer doctor does); if nobody outside can "
            "dial it (behind a NAT), it goes on in client mode and says so in one line.")
    nat_port_map: bool = setting(False, local=True, help="Opt-in UPnP/NAT-PMP port mapping on the local gateway.")
    relay_via: list[str] = setting(factory=list, local=True, help="Behind a NAT, not in client mode: multiaddrs "
            "(/ip4/HOST/tcp/PORT/p2p/PEER_ID) of public nodes that run relay_service (e.g. swarm-bootstrap "
            "--relay-service); this peer reserves a slot on each and others dial it through them (libp2p circuit "
            "relay, /p2p-circuit addresses), so it can reduce spans; everything they send it crosses a relay's link. "
            "Skips reachability_check. Only for a peer nobody can dial: it stops advertising its public addresses.")
    relay_service: bool = setting(False, local=True, help="A public peer: relay for the peers that name it in "
            "relay_via (up to 30 min and 4 GiB per relayed connection; all their inbound traffic crosses this "
            "peer's link).")
    min_peers: int = setting(1, local=True, help="Wait at start until this many peers of the run are visible "
            "(bounded by start_timeout).")
    start_timeout: float = setting(120.0, local=True, help="Seconds to wait for min_peers, and for every visible "
            "peer to be greeted, before training anyway.")
    min_group_size: int = setting(2, help="Smallest group that averages; a peer alone skips the round (its progress "
            "is kept).")
    group_cap: int = setting(64, help="Above this many live peers a round runs in two levels: groups of at most "
            "this many, whose reducers then meet the other groups' (peer/net/round/levels.py); 0: always one group of "
            "all.")
    matchmaking_time: float = setting(15.0, help="Seconds a group leader waits for stragglers; the group forms at "
            "once when every live peer joined.")
    straggler_wait: float = setting(2.0, local=True, help="Seconds per round, on average, that a group this peer "
            "leads keeps waiting for one peer once more than half of the peers it expects joined: a peer seldom late "
            "saves up to matchmaking_time, one late at every round costs this much a round "
            "(peer/net/view/punctuality.py); matchmaking_time or more: wait for every peer as long as for any.")
    matchmaking_timeout: float = setting(30.0, help="Seconds to find a group for a round before the round counts as "
            "missed.")
    matchmaking_patience: float = setting(60.0, local=True, help="Steps schedule: seconds a peer keeps looking for a "
            "group past matchmaking_timeout while a live peer's record shows it has not reached this round yet (it "
            "is behind by wall time: the peer ahead yields).")
    request_timeout: float = setting(3.0, help="Seconds to wait for one matchmaking request to a potential leader.")
    dht_timeout: float = setting(5.0, local=True, help="Seconds to wait for one DHT request; a node that does not "
            "answer is skipped (and banned a while).")
    allreduce_timeout: float = setting(60.0, help="Seconds a member waits for all averaged spans after its group "
            "formed.")
    part_timeout: float = setting(30.0, help="Seconds a reducer waits for members' parts before averaging what it "
            "has (< allreduce_timeout).")
    deadlines: str = setting("measured", help="measured: a round's part and all-reduce deadlines and a state "
            "donor's follow the peers' measured uplinks and the fragment's size (peer/net/flow/links.py), with "
            "part_timeout, allreduce_timeout and state_timeout as floors and deadline_max as ceiling; fixed: those "
            "settings, whatever the links.")
    span_sizing: str = setting("links", help="links: a reducer whose declared link (uplink, or download cap where "
            "lower) is under half the group's median gets a span in proportion, down to 1/8 of an equal one, the "
            "others equal spans (peer/net/round/group.py link_shares); equal: equal spans.")
    deadline_margin: float = setting(3.0, help="Measured deadlines: a stage may take this many times what the "
            "declared links predict.")
    deadline_max: float = setting(600.0, help="Measured deadlines: the longest any of them gets (a peer that "
            "declares a tiny uplink makes its groups wait at most this).")
    chunk_bytes: int = setting(1 << 20, help="Target payload bytes of one streamed all-reduce message.")
    progress_period: float = setting(5.0, help="Seconds between progress records published to the DHT.")
    progress_ttl: float = setting(30.0, help="Lifetime of a progress record: a peer silent this long no longer "
            "counts as live.")
    startup_timeout: float = setting(30.0, local=True, help="Seconds for the local DHT/p2p daemon to start.")
    join_timeout: float = setting(60.0, local=True, help="Seconds to keep retrying the initial peers (with backoff) "
            "before giving up with their addresses.")
    state_timeout: float = setting(60.0, help="Seconds a donor gets for its parts of one fragment's outer state "
            "before the next donor takes them.")
    state_donors: int = setting(3, local=True, help="Donors a state download takes parts of a fragment from at "
            "once (each part verified on its own).")
    max_state_uploads: int = setting(2, local=True, help="State downloads this peer serves at once; more joiners "
            "are told it is busy and go to another donor.")
    drift_check_period: float = setting(10.0, help="Seconds between checks of our (round, digest) against the "
            "swarm's majority (0 disables).")
    max_streams_per_peer: int = setting(16, local=True, help="Streams one remote peer may hold open in this peer's "
            "handlers at once (all-reduce parts, state downloads, join requests); more are refused.")
    max_streams: int = setting(512, local=True, help="Streams all remote peers together may hold open in this peer's "
            "handlers at once.")
    max_streams_per_host: int = setting(64, local=True, help="Streams the peers of one host (an IPv4 address, an "
            "IPv6 /64) may hold open in this peer's handlers at once, however many identities it runs; relayed and "
            "loopback peers are counted one by one.")
    partner_share: float = setting(0.25, local=True, help="The share of swarm.max_streams kept for peers this peer "
            "averaged with lately: strangers, however many, hold the rest at most.")
    exclude_after: int = setting(3, local=True, help="Offences (parts that do not decode, parts the robust rule cut "
            "hard, implausible averages) after which this peer stops working with another for the rest of the run "
            "(see peer/net/trust/exclusion.py).")

    @property
    def witness_timeout(self) -> float:
        """Seconds a round gets to publish its group's claims and read everyone's before it applies (a store waits up
        to 2 x dht_timeout while a DHT node is unreachable, a read about one: peer/net/witness.py)."""
        return 3 * self.dht_timeout

    def __post_init__(self) -> None:
        check(bool(self.run_id) and "." not in self.run_id and " " not in self.run_id, "swarm.run_id",
               "a non-empty name without '.' or spaces", self.run_id)
        check(self.drift_check_period >= 0, "swarm.drift_check_period", ">= 0", self.drift_check_period)
        check(self.exclude_after >= 1, "swarm.exclude_after", ">= 1", self.exclude_after)
        check(not (self.relay_via and (self.client_mode or self.relay_service)), "swarm.relay_via",
               "empty with swarm.client_mode or swarm.relay_service (a relayed peer is behind a NAT and dialed)",
               self.relay_via)
        check(self.group_cap == 0 or max(2, self.min_group_size) <= self.group_cap <= 256, "swarm.group_cap",
               "0 or in [max(2, swarm.min_group_size), 256]", self.group_cap)
        check(1 <= self.state_donors <= 16, "swarm.state_donors", "in [1, 16]", self.state_donors)
        check(self.max_state_uploads >= 1, "swarm.max_state_uploads", ">= 1", self.max_state_uploads)
        check(self.max_streams_per_peer >= 4, "swarm.max_streams_per_peer", ">= 4 (rounds of several fragments, "
               "a download and a join request at once)", self.max_streams_per_peer)
        check(self.max_streams >= self.max_streams_per_peer, "swarm.max_streams", ">= swarm.max_streams_per_peer",
               self.max_streams)
        check(self.max_streams_per_peer <= self.max_streams_per_host <= self.max_streams, "swarm.max_streams_per_host",
              "between swarm.max_streams_per_peer and swarm.max_streams", self.max_streams_per_host)
        check(0.0 <= self.partner_share <= 0.5, "swarm.partner_share",
              "between 0 and 0.5 (strangers, newcomers among them, need the rest)", self.partner_share)
        for key in ("start_timeout", "state_timeout", "matchmaking_time", "matchmaking_timeout", "request_timeout",
                    "allreduce_timeout", "part_timeout", "progress_period", "progress_ttl", "startup_timeout",
                    "dht_timeout", "join_timeout"):
            check(getattr(self, key) > 0, f"swarm.{key}", "> 0 seconds", getattr(self, key))
        check(self.matchmaking_patience >= 0, "swarm.matchmaking_patience", ">= 0 seconds", self.matchmaking_patience)
        check(self.straggler_wait > 0, "swarm.straggler_wait", "> 0 seconds", self.straggler_wait)
        check(self.min_peers >= 1, "swarm.min_peers", ">= 1", self.min_peers)
        check(self.min_group_size >= 1, "swarm.min_group_size", ">= 1", self.min_group_size)
        check(self.part_timeout < self.allreduce_timeout, "swarm.part_timeout", "< swarm.allreduce_timeout",
               self.part_timeout)
        check(self.deadlines in ("measured", "fixed"), "swarm.deadlines", "measured or fixed", self.deadlines)
        check(self.span_sizing in ("links", "equal"), "swarm.span_sizing", "links or equal", self.span_sizing)
        check(self.deadline_margin >= 1, "swarm.deadline_margin", ">= 1", self.deadline_margin)
        check(self.deadline_max >= max(self.allreduce_timeout, self.state_timeout), "swarm.deadline_max",
               ">= swarm.allreduce_timeout and swarm.state_timeout", self.deadline_max)
        check(self.request_timeout < self.matchmaking_time, "swarm.request_timeout", "< swarm.matchmaking_time "
               "(hivemind's matchmaking can deadlock otherwise)", self.request_timeout)
        check(self.matchmaking_time < self.matchmaking_timeout, "swarm.matchmaking_time",
               "< swarm.matchmaking_timeout", self.matchmaking_time)
        # While a DHT node is unreachable a record reaches the DHT up to one dht_timeout late and is read up
        # to another one late: a record must outlive a period and both, or live peers drop out of view.
        check(self.progress_ttl > self.progress_period + 2 * self.dht_timeout, "swarm.progress_ttl",
               "> swarm.progress_period + 2 * swarm.dht_timeout", self.progress_ttl)
        check(self.progress_ttl <= MAX_RECORD_TTL, "swarm.progress_ttl", f"<= {MAX_RECORD_TTL:.0f} (DHT nodes keep "
              "no record longer)", self.progress_ttl)
        check(4096 <= self.chunk_bytes <= 1 << 24, "swarm.chunk_bytes", "in [4096, 16777216]", self.chunk_bytes)
