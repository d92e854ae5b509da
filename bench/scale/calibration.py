"""The costs the simulation takes from our own measurements (docs/benchmarks.md) and the run's defaults
(peer/config/network.py, peer/config/sections.py), each with its source. Everything else the simulation assumes is
in ``Workload``'s docs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9


@dataclass(kw_only=True, frozen=True)
class Costs:
    """Measured costs. Sources (docs/benchmarks.md unless said otherwise):"""

    # "Codec throughput" (2026-11-21, this 2-core CPU machine, 2 threads): GB/s of fp32 input.
    e3m0_encode_gbps: float = 2.16
    e3m0_decode_gbps: float = 2.37
    fp8_encode_gbps: float = 1.64
    fp8_decode_gbps: float = 1.22
    # The clipped rule's combine, part-elements per second, 1 thread: timed for this simulation (2026-11-24, this
    # machine, loaded): 8 parts of 1M elements 0.31 s (27 M/s), 4 parts 0.13 s (32 M/s).
    combine_elems_per_s: float = 25e6
    # "Compute utilization under a shaped link", blocking rows: a round moving 7.29 MB each way per peer took 1.93 s
    # at 50 Mbit/s and 7.99 s at 10 Mbit/s (medians). Fitting round = overhead + bytes / (efficiency * rate) to the
    # two gives efficiency 0.77 and overhead 0.42 s. Check on the streaming row at 50 Mbit/s (0.51 MB): 0.53 s
    # predicted, 0.54 s measured. (Streaming at 10 Mbit/s: 0.95 s predicted, 1.55 s measured: not explained.)
    link_efficiency: float = 0.77
    round_overhead_s: float = 0.42  # matchmaking, stream setup and p2pd on a LAN, per round (4 peers)
    # "Chaos: random SIGKILLs": median 15 s from a kill to the resumed peer (process, DHT and model start).
    restart_s: float = 15.0
    # The state a joiner downloads: G and v of every fragment, fp32 (docs/architecture.md "Joining").
    state_bytes_per_param: float = 8.0

    def encode_s(self, elems: float, codec: str = "e3m0") -> float:
        return elems * 4 / ((self.e3m0_encode_gbps if codec == "e3m0" else self.fp8_encode_gbps) * GB)

    def decode_s(self, elems: float, codec: str = "e3m0") -> float:
        return elems * 4 / ((self.e3m0_decode_gbps if codec == "e3m0" else self.fp8_decode_gbps) * GB)

    def combine_s(self, part_elems: float) -> float:
        return part_elems / self.combine_elems_per_s


BITS = {"e3m0": 4.5, "fp8": 8.5, "bf16": 16.0, "fp32": 32.0}  # bits per element on the wire (protos/codec.proto)


@dataclass(kw_only=True, frozen=True)
class Timeouts:
    """The swarm's defaults (peer/config/network.py SwarmConfig, peer/config/sections.py OuterConfig)."""

    matchmaking_time: float = 15.0
    matchmaking_timeout: float = 30.0
    part_timeout: float = 30.0
    allreduce_timeout: float = 60.0
    wait_timeout: float = 180.0
    progress_period: float = 5.0
    progress_ttl: float = 30.0
    max_group_size: int = 256  # peer/net/round/group.py MAX_GROUP_SIZE: a larger group is a GroupError on every member
    max_streams: int = 512  # swarm.max_streams: incoming streams a peer admits in all


@dataclass(kw_only=True, frozen=True)
class Workload:
    """What the peers train and how they sync. Defaults (assumptions, not measurements): the "100M" preset (88M
    parameters at vocab 32000, docs/benchmarks.md "Memory by size"), fragments of k = 3 blocks (P = 3 of its 9),
    FP4 e3m0 on the wire, the clock schedule's default round_seconds 60 (a fragment round every 20 s), a step of
    1 s on a volunteer GPU (an assumption), tau 10 steps (tau_max, the most ``tau = auto`` takes)."""

    params: float = 88e6
    fragments: int = 3
    codec: str = "e3m0"
    round_seconds: float = 60.0
    step_s: float = 1.0
    tau_steps: int = 10
    client_fraction: float = 0.2  # peers behind NAT in client mode (an assumption)
    dht_replicas: int = 5  # hivemind's DHT num_replicas: nodes that hold a key (the matchmaking key's hot spot)
    declare_bytes: int = 100  # one peer's entry under the round's matchmaking key (peer id, expiration, framing)
    member_info_bytes: int = 80  # one member in the leader's group message (peer id + MemberInfo)
    costs: Costs = field(default_factory=Costs)
    timeouts: Timeouts = field(default_factory=Timeouts)

    @property
    def fragment_elems(self) -> float:
        return self.params / self.fragments

    @property
    def slot_s(self) -> float:
        """Seconds between two fragment rounds on the clock schedule (round r of p at (r + p/P) * T)."""
        return self.round_seconds / self.fragments

    @property
    def tau_s(self) -> float:
        return self.tau_steps * self.step_s

    def wire_bytes(self, elems, codec: str = "") -> float:
        return elems * BITS[codec or self.codec] / 8
