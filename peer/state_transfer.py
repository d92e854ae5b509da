"""State transfer: a joining or drifted peer downloads a fragment's shared outer state from a donor.

Every peer keeps an immutable :class:`Snapshot` of each fragment's ``G, v, round`` taken right after
it applied a round, serves it with ``StateServicer.rpc_download`` (protos/state.proto) in chunks of
at most ``chunk_elems`` elements, and advertises ``(round, digest)`` in its progress record. The
receiver checks every chunk (fragment, offsets, sizes, finiteness) and the digest of the assembled
``G`` against the majority's before using anything, and moves to the next donor on any failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence

import numpy as np
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase

from peer.outer import digest_of
from peer.proto import state_pb2 as pb

log = logging.getLogger(__name__)


class DownloadError(RuntimeError):
    """No donor delivered a verified state."""


@dataclass(frozen=True)
class Snapshot:
    """A fragment's shared outer state after ``round`` rounds (tensors are never modified)."""

    fragment: int
    round: int
    step: int
    G: torch.Tensor
    v: torch.Tensor
    digest: str


def _f32(t: torch.Tensor) -> bytes:
    return t.numpy().astype("<f4", copy=False).tobytes()


class StateServicer(ServicerBase):
    """Serves this peer's last two snapshots of each fragment (a requester may have seen the previous
    round advertised). :meth:`publish` may be called from any thread (item assignments of new
    objects); the handler reads one snapshot object per request."""

    def __init__(self, chunk_elems: int):
        self.chunk_elems = chunk_elems
        self.snapshots: dict[int, Snapshot] = {}  # the newest, per fragment
        self.previous: dict[int, Snapshot] = {}

    def publish(self, snap: Snapshot) -> None:
        old = self.snapshots.get(snap.fragment)
        if old is not None and old.round != snap.round:
            self.previous[snap.fragment] = old
        self.snapshots[snap.fragment] = snap

    def _find(self, fragment: int, round_: int):
        for snap in (self.snapshots.get(fragment), self.previous.get(fragment)):
            if snap is not None and (round_ == 0 or snap.round == round_):
                return snap
        return None

    async def rpc_download(self, request: pb.StateRequest, context: P2PContext) -> AsyncIterator[pb.StateChunk]:
        snap = self._find(request.fragment, request.round)
        if snap is None:
            yield pb.StateChunk(fragment=request.fragment, error=f"no state for fragment {request.fragment} "
                                                                 f"round {request.round}")
            return
        numel = snap.G.numel()
        for offset in range(0, numel, self.chunk_elems):
            end = min(numel, offset + self.chunk_elems)
            msg = pb.StateChunk(fragment=snap.fragment, offset=offset, g=_f32(snap.G[offset:end]),
                                v=_f32(snap.v[offset:end]))
            if offset == 0:
                msg.round, msg.digest, msg.numel, msg.step = snap.round, snap.digest, numel, snap.step
            yield msg


async def _download_from(p2p: P2P, donor: PeerID, fragment: int, round_: int, numel: int, digest: str,
                         deadline: float, max_chunk_elems: int) -> Snapshot:
    stub = StateServicer.get_stub(p2p, donor)
    stream = await asyncio.wait_for(stub.rpc_download(pb.StateRequest(fragment=fragment, round=round_)),
                                    timeout=max(0.0, deadline - time.monotonic()))
    G, v = torch.empty(numel), torch.empty(numel)
    filled, header = 0, None
    try:
        while filled < numel:
            msg = await asyncio.wait_for(stream.__anext__(), timeout=max(0.0, deadline - time.monotonic()))
            if msg.error:
                raise DownloadError(f"donor says: {msg.error}")
            if header is None:
                header = msg
                if msg.numel != numel or msg.digest != digest:
                    raise DownloadError(f"donor offers numel {msg.numel} digest {msg.digest[:12]}, "
                                        f"want {numel} {digest[:12]}")
            n = len(msg.g) // 4
            if (msg.fragment != fragment or msg.offset != filled or n == 0 or n > max_chunk_elems
                    or len(msg.g) != 4 * n or len(msg.v) != 4 * n or filled + n > numel):
                raise DownloadError(f"malformed chunk at offset {msg.offset} ({len(msg.g)} bytes)")
            G[filled:filled + n] = torch.from_numpy(np.frombuffer(msg.g, dtype="<f4").astype(np.float32))
            v[filled:filled + n] = torch.from_numpy(np.frombuffer(msg.v, dtype="<f4").astype(np.float32))
            filled += n
    finally:
        await stream.aclose()
    if not (bool(torch.isfinite(G).all()) and bool(torch.isfinite(v).all())):
        raise DownloadError("state has non-finite values")
    got = digest_of(G)
    if got != digest:
        raise DownloadError(f"digest of the downloaded state is {got[:12]}, advertised {digest[:12]}")
    return Snapshot(fragment, int(header.round), int(header.step), G, v, got)


async def download(p2p: P2P, donors: Sequence[PeerID], fragment: int, *, round_: int, numel: int, digest: str,
                   timeout_per_donor: float, max_chunk_elems: int) -> Snapshot:
    """Downloads round ``round_`` of fragment ``fragment`` from the first donor that delivers a verified state."""
    errors = []
    for donor in donors:
        try:
            return await _download_from(p2p, donor, fragment, round_, numel, digest,
                                        time.monotonic() + timeout_per_donor, max_chunk_elems)
        except Exception as e:  # a dead, slow or lying donor: try the next one
            log.warning("state download of fragment %d from %s failed: %s: %s", fragment, str(donor)[-8:],
                        type(e).__name__, e)
            errors.append(f"{str(donor)[-8:]}: {type(e).__name__}")
    raise DownloadError(f"fragment {fragment}: no donor delivered a verified state ({'; '.join(errors) or 'no donors'})")


@dataclass(frozen=True)
class CatchUp:
    """Fragment ``fragment`` should be replaced by the majority's state ``(round, digest)`` held by ``donors``."""

    fragment: int
    round: int
    digest: str
    donors: list[str]
    reason: str


def _others(records: dict, me: str, fragment: int) -> list[tuple[str, int, str]]:
    """(peer id, applied round, digest) of ``fragment`` for every other peer that advertises it."""
    return [(rec.peer_id, rec.rounds[fragment], rec.digests[fragment]) for rec in records.values()
            if rec.peer_id != me and len(rec.rounds) > fragment and len(rec.digests) > fragment]


def swarm_state(records: dict, me: str, fragment: int) -> Optional[tuple[int, str, list[str]]]:
    """The swarm's state of ``fragment``: the (applied round, digest) held by the most other peers (ties: the
    later round, then the smaller digest), with its holders; None if no other peer advertises one."""
    holders: dict[tuple[int, str], list[str]] = {}
    for pid, r, d in _others(records, me, fragment):
        holders.setdefault((r, d), []).append(pid)
    if not holders:
        return None
    (best, digest), donors = max(holders.items(), key=lambda kv: (len(kv[1]), kv[0][0], [-ord(c) for c in kv[0][1]]))
    return best, digest, donors


def launch_gate(records: dict, me: str, fragment: int, round_: int, my_expected: int) -> Optional[str]:
    """Why round ``round_`` of ``fragment`` must not be launched from our state (None: launch it).

    ``my_expected`` is the last round our state will have applied once our rounds in flight land.

    - *late*: the swarm already applied that round, so no one will come to it;
    - *behind*: the swarm applied two or more rounds our state never will (our round counter ran on alone
      during a network outage, say): our outer gradient is relative to a state the swarm left long ago.

    Both are repaired by downloading the swarm's state at once (``plan_catch_up`` with ``expected``),
    instead of waiting ``matchmaking_timeout`` for a group that never forms. One round behind
    (we missed the last one) we still launch: we join the swarm's current round, and the drift check
    replaces our state, which then differs, with the swarm's a round later. Skipping instead would leave
    us behind again by the time the download is done, round after round.
    """
    late = swarm_is_past(records, me, fragment, round_)
    if late:
        return late
    state = swarm_state(records, me, fragment)
    if state is not None and state[0] >= my_expected + 2:
        return f"behind: our state stops at round {my_expected}, the swarm applied {state[0]}"
    return None


def swarm_is_past(records: dict, me: str, fragment: int, round_: int) -> Optional[str]:
    """Why no group will form for round ``round_`` of ``fragment`` any more (the swarm's state already
    includes it: we are late), or None."""
    state = swarm_state(records, me, fragment)
    return f"late: the swarm already applied round {state[0]}" if state and state[0] >= round_ else None


def plan_catch_up(records: dict, me: str, my_rounds: Sequence[int], my_digests: Sequence[str], *,
                  joining: bool, expected: Optional[Sequence[int]] = None) -> list[CatchUp]:
    """Which fragments to download, from the other peers' progress records (pure; see below).

    Rounds here are *applied* rounds (a peer that trained alone does not advance). For each fragment,
    the swarm's state is :func:`swarm_state`. We download it when we are behind: ``joining``, by any round;
    with ``expected`` (per fragment, the round our state reaches once our rounds in flight land; given when
    a round was just found late, see :func:`launch_gate`), when the swarm is past it; otherwise by two or
    more, since a peer may see others a moment after they applied the round it is about to apply. Or when
    no other peer at our exact round holds our digest and theirs wins: it is held by two or more, or it is
    the smaller of a tie (two survivors of a broken round converge on one state).
    """
    plans = []
    for p, (mine_r, mine_d) in enumerate(zip(my_rounds, my_digests)):
        state = swarm_state(records, me, p)
        if state is None:
            continue
        best, digest, donors = state
        others = _others(records, me, p)
        same_round = [d for _, r, d in others if r == mine_r]
        if best > mine_r and (joining or best >= mine_r + 2 or (expected is not None and best > expected[p])):
            plans.append(CatchUp(p, best, digest, donors, f"behind: round {mine_r}, swarm at {best}"))
        elif same_round and mine_d not in same_round:
            # We disagree with everyone at our round. The most common digest there wins, ties going to
            # the smallest, so two survivors of a broken round converge on one state.
            counts = {d: same_round.count(d) for d in same_round}
            winner = min(counts, key=lambda d: (-counts[d], d))
            if counts[winner] > 1 or winner < mine_d:
                holders = [pid for pid, r, d in others if r == mine_r and d == winner]
                plans.append(CatchUp(p, mine_r, winner, holders,
                                     f"digest {mine_d[:12]} disagrees with the swarm's at round {mine_r}"))
    return plans
