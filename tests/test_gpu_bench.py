"""bench/gpu.py's echo transport: what a round gives back is the swarm's, computed as the swarm computes it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu as bench  # noqa: E402

from peer.outer.codec import roundtrip  # noqa: E402
from peer.outer.rounds import RoundStatus  # noqa: E402


@pytest.mark.parametrize("codec", ["e3m0", "topk32"])
def test_the_echo_round_is_the_codecs_round_trip_in_the_swarms_pieces(codec):
    """Pieces of swarm.chunk_bytes start at multiples of every codec's block, so the average is the whole round
    trip's, bit for bit (a tail piece included); the round is a complete group's."""
    delta = torch.randn(3 * (1 << 18) + 1000, generator=torch.Generator().manual_seed(0))
    echo = bench.EchoTransport(codec, chunk_bytes=1 << 20)
    try:
        outcome = echo.launch(fragment=1, round_=7, delta=delta, weight=3.0, step=0, expected_round=7).result(60)
    finally:
        echo.pool.shutdown()
    assert outcome.status == RoundStatus.OK and outcome.total_weight == 6.0 and outcome.group_size == 2
    (span,) = outcome.spans
    assert (span.start, span.end) == (0, delta.numel())
    assert torch.equal(span.average, roundtrip(delta, codec))
