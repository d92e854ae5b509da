"""The progress record a peer publishes in the DHT (pure data: the phase and catch-up policy of
``peer/net/policy/consensus.py`` reads it; ``peer/net/trust/progress.py`` signs, validates and collects it).

Every value is checked strictly: records come from other peers.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Optional

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Steps and rounds: far above any real run (2^40 rounds of one minute is two million years), far below what
# overflows a tensor index or a timestamp computation downstream (a record with 2^63 rounds made peers crash).
Count = Annotated[StrictInt, Field(ge=0, le=1 << 40)]
# On the wire (ProgressRecord.from_wire): a libp2p peer id in base58 (CIDv0 "Qm...", or an inlined key
# "12D3..."; the state donors and the phase rules act on it) and hex digests, or the whole record is refused.
PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")
DIGEST = re.compile(r"[0-9a-f]{1,64}")
MAX_PASS_CHARS = 4096  # a pass line: ~400 bytes of key, ~350 of signature, in base64
MAX_FRAGMENTS = 512  # fragments a run may have: a record's per-fragment lists (the largest record fits a DHT value)
MAX_PAST = 64  # entries of a record's ``past`` (a few rounds per fragment; fewer when there are many fragments)


class ProgressRecord(BaseModel):
    """One peer's progress (values are checked strictly: they come from other peers)."""

    peer_id: StrictStr
    step: Count  # inner steps made
    round: Count  # rounds completed of fragment 0
    # per fragment: rounds applied and the hex digest of G after them (drift check, state donors)
    rounds: list[Count] = Field(default_factory=list, max_length=MAX_FRAGMENTS)
    digests: list[Annotated[StrictStr, Field(max_length=64)]] = Field(default_factory=list, max_length=MAX_FRAGMENTS)
    # earlier applied rounds, as (fragment, round, digest), a few per fragment: lets the drift check compare
    # digests at the same round when rounds are faster than records (consensus.digest_at)
    past: list[tuple[Count, Count, Annotated[StrictStr, Field(max_length=64)]]] = Field(default_factory=list,
                                                                                        max_length=MAX_PAST)
    # rounds this peer is looking for a group for right now, as [fragment, round] (the phase rules, consensus.py)
    seeking: list[Annotated[list[Count], Field(min_length=2, max_length=2)]] = Field(default_factory=list,
                                                                                     max_length=64)
    # rounds this peer is averaging in right now (its group formed), as [fragment, round]: a peer that is still
    # waiting for its leader's word may be in that group (consensus.nobody_coming)
    averaging: list[Annotated[list[Count], Field(min_length=2, max_length=2)]] = Field(default_factory=list,
                                                                                       max_length=64)
    tokens_per_second: Annotated[StrictFloat, Field(ge=0.0, allow_inf_nan=False)]
    # authenticated runs: this peer's pass (peer/net/trust/auth.py, a "swarmloco-pass:..." line); "" in open runs
    pass_line: Annotated[StrictStr, Field(max_length=MAX_PASS_CHARS)] = ""
    client_mode: StrictBool
    # paused by its owner (swarm-peer pause, or outside its active hours): in the swarm's view (the monitor, the
    # status's paused count) but in no group, no vote and no wait: every rule acts on live, unpaused records
    paused: StrictBool = False
    # the loss of its last inner step (the monitor's loss chart); None before the first step
    loss: Optional[Annotated[StrictFloat, Field(ge=0.0, le=1e6, allow_inf_nan=False)]] = None
    # the shared model's held-out loss at its last evaluation (peer/run/evaluation.py) and fragment 0's round it was
    # made at (the monitor's held-out chart); None before the first
    eval_loss: Optional[Annotated[StrictFloat, Field(ge=0.0, le=1e6, allow_inf_nan=False)]] = None
    eval_round: Count = 0
    version: Annotated[StrictStr, Field(max_length=32)] = ""  # its swarmloco version (the monitor's peer list)
    # its uplink in bytes/s as its reducers timed its parts (peer/net/flow/links.py; 0: not measured yet): a joiner
    # gives it, as a state donor, the time its share takes through that link
    upload_bytes_per_second: Annotated[StrictFloat, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    time: Annotated[StrictFloat, Field(allow_inf_nan=False)]  # DHT time when written

    @classmethod
    def from_wire(cls, value: Any) -> "ProgressRecord":
        """A record read from the DHT: the schema, plus a real peer id and hex digests. Raises ValueError
        (pydantic's ValidationError is one)."""
        rec = cls.model_validate(value)
        digests = [*rec.digests, *(d for _, _, d in rec.past)]
        if not PEER_ID.fullmatch(rec.peer_id) or not all(DIGEST.fullmatch(d) for d in digests):
            raise ValueError("progress record with a malformed peer id or digest")
        return rec


def live_at(rec: ProgressRecord, now: float, ttl: float) -> bool:
    """Whether ``rec``, found in one read of the records at DHT time ``now``, is live: written within ``ttl`` seconds
    (``progress_ttl``). The monitor and the doctor's probe judge so; a peer's own view of the swarm judges by arrival
    instead (:class:`~peer.net.trust.progress.LiveView`)."""
    return rec.time + ttl >= now
