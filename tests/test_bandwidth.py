"""Bandwidth caps (peer/net/flow/bandwidth.py): the pacer's bookkeeping on a fake clock, the limits that carry the caps,
and a state transfer on loopback that a cap slows to its rate (a lower bound on the time: a loaded machine only
makes it slower). The rate a capped peer keeps in a swarm over real links: bench/bandwidth.py."""

import asyncio
import math
import time

import pytest
import torch

from helpers import p2p_mesh, run_async
from peer.config import ConfigError, MBIT, LimitsConfig
from peer.control.limits import Limits
from peer.net.flow.bandwidth import BURST_S, MIN_RATE, Bandwidth, Pacer, cap_warnings, share
from peer.net.flow.credit import MIN_WINDOW, WINDOW_S, CreditError, SendWindow, window
from peer.net.flow.streams import StreamGuard
from peer.net.state_transfer import ServedState, StateServicer, download
from peer.outer.state import digest_of


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_uncapped_pacer_never_waits_and_counts_bytes():
    pacer = Pacer(lambda: 0.0)
    assert [pacer.delay(1 << 20) for _ in range(100)] == [0.0] * 100
    assert pacer.total == 100 << 20


def test_a_pacer_spreads_bytes_at_its_rate_after_a_burst_allowance():
    clock, rate = FakeClock(), 1000.0
    pacer = Pacer(lambda: rate, clock)
    # idle: the first BURST_S seconds' worth go at once
    assert pacer.delay(int(rate * BURST_S)) == 0.0
    # then every byte waits its turn: 10 messages of 100 B queue up 0.1 s apart
    waits = [pacer.delay(100) for _ in range(10)]
    assert waits == pytest.approx([0.1 * (i + 1) for i in range(10)])
    # a caller that waited its delay finds the next message costing exactly its size
    clock.now += waits[-1]
    assert pacer.delay(500) == pytest.approx(0.5)
    # after a long idle spell the allowance is BURST_S again, not more
    clock.now += 3600
    assert pacer.delay(int(rate * BURST_S)) == 0.0
    assert pacer.delay(100) == pytest.approx(0.1)


def test_a_changed_rate_applies_from_the_next_message():
    clock, rate = FakeClock(), [1000.0]
    pacer = Pacer(lambda: rate[0], clock)
    pacer.delay(int(1000 * BURST_S))
    assert pacer.delay(1000) == pytest.approx(1.0)
    rate[0] = 10_000.0
    clock.now += 1.0
    assert pacer.delay(1000) == pytest.approx(0.1)
    rate[0] = 0.0  # cap removed: no wait at all
    assert pacer.delay(10 ** 9) == 0.0


def test_a_receivers_declared_cap_is_shared_by_its_senders_and_bounded_below():
    assert share(12e6, 3) == 4e6 and share(12e6, 0) == 12e6
    assert share(0.0, 3) == 0.0 and share(float("nan"), 3) == 0.0 and share(-5.0, 1) == 0.0  # no cap
    assert share(1.0, 2) == MIN_RATE / 2  # a hostile 1 byte/s holds nobody that long


def test_credit_windows_cover_a_tenth_of_a_second_of_the_cap_and_none_without_one():
    assert window(0.0, 65536) == 0 and window(float("inf"), 65536) == 0 and window(-1.0, 100) == 0
    assert window(1.0, 65536) == MIN_WINDOW  # a tiny cap: one message read, one on its way
    assert window(100 * MBIT, 65536) == math.ceil(100 * MBIT * WINDOW_S / 65536)


def test_a_sender_waits_for_credit_and_refuses_credit_no_honest_receiver_sends():
    async def main():
        credit = SendWindow(2)
        deadline = time.monotonic() + 5
        await credit.wait(deadline)
        await credit.wait(deadline)  # two in flight: the window is full
        third = asyncio.ensure_future(credit.wait(deadline))
        await asyncio.wait([third], timeout=0.05)
        assert not third.done()  # blocked until a credit comes
        credit.grant(1)
        await asyncio.wait_for(third, 5)
        assert credit.sent == 3
        for bad in (1, 0, 4):  # not counting up, or counting a message never sent
            with pytest.raises(CreditError):
                credit.grant(bad)
        with pytest.raises(asyncio.TimeoutError):  # a receiver that never grants holds us to the deadline only
            await credit.wait(time.monotonic() + 0.05)
        free = SendWindow(0)
        for _ in range(100):
            await free.wait(time.monotonic())  # no credit: never waits
    run_async(main())


def test_limits_carry_the_caps_in_mbit_per_second_and_refuse_nonsense():
    limits = Limits(upload_mbps=8, download_mbps=0.5)
    assert limits.byte_rates() == (1_000_000, 62_500)
    for bad in (-1.0, float("nan"), float("inf"), 2e6, 0.05):
        with pytest.raises(ValueError, match="upload cap must be 0 \\(none\\) or 0.1..1e\\+06 Mbit/s"):
            Limits(upload_mbps=bad)
    with pytest.raises(ConfigError, match="limits.download_mbps"):
        LimitsConfig(download_mbps=-3)


def test_caps_that_break_the_rounds_deadlines_are_named():
    transfers = [("all-reduce", 10e6, 30, "allreduce_timeout"), ("state transfer", 40e6, 60, "state_timeout")]
    # 10 MB per all-reduce direction at 1 Mbit/s = 80 s, against 30 s; the state transfer (40 MB) at 1 Mbit/s too
    lines = cap_warnings((1 * MBIT, 0.0), transfers)
    assert len(lines) == 2 and all("upload cap of 1 Mbit/s" in line for line in lines), lines
    assert "all-reduce take ~80 s, against swarm.allreduce_timeout = 30 s" in lines[0]
    assert "state transfer take ~320 s, against swarm.state_timeout = 60 s" in lines[1]
    # at 4 Mbit/s the all-reduce fits (20 s of 30), the state transfer does not (80 s of 60)
    only = cap_warnings((0.0, 4 * MBIT), transfers)
    assert len(only) == 1 and "download cap of 4 Mbit/s makes the largest fragment's state transfer" in only[0]
    assert cap_warnings((100 * MBIT, 100 * MBIT), transfers) == []
    assert cap_warnings((0.0, 0.0), [("x", 1e12, 1, "y")]) == []


class DeclaresOnly(Pacer):
    """A receiver's pacer that declares its cap but reads at full speed: what remains is the donor's pacing."""

    async def take(self, nbytes: int) -> None:
        self.total += nbytes


@pytest.mark.parametrize("side", ["donor's upload", "receiver's download", "receiver's declared cap"])
def test_a_capped_state_transfer_takes_at_least_its_bytes_over_the_cap(side):
    """1M elements of G and v (8 MB in 100k-element chunks) at a 16 Mbit/s (2 MB/s) cap: at least 3.75 s
    (4 s less the burst allowance), and the state arrives whole. A receiver's cap binds its donor, which paces
    the stream to the rate the request declares (reading slowly alone would not slow the link: the transport's
    buffers hold megabytes). The download's sample of the receiver's downlink (peer/net/flow/links.py) is at most the
    cap."""
    numel, rate = 1_000_000, 16 * MBIT
    samples = []
    G, v = torch.randn(numel), torch.randn(numel)
    snap = ServedState(0, 3, 30, G, v, digest_of(G, v))

    async def fetch(upload: float, down: float):
        donor_bw, receiver_bw = Bandwidth(lambda: (upload, 0.0)), Bandwidth(lambda: (0.0, down))
        donor, receiver = await p2p_mesh(2)
        try:
            servicer = StateServicer(100_000, guard=StreamGuard(per_peer=4, total=64), request_timeout=5.0,
                                     stream_timeout=60.0, upload=donor_bw.upload)
            servicer.publish(snap)
            await servicer.add_p2p_handlers(donor)
            t0 = time.monotonic()
            pacer = DeclaresOnly(lambda: down) if side == "receiver's declared cap" else receiver_bw.download
            got = await download(receiver, [donor.peer_id], 0, round_=3, numel=numel, digest=snap.digest,
                                 timeout_per_donor=60, max_chunk_elems=100_000, pacer=pacer,
                                 on_sample=lambda n, s: samples.append((n, s)))
            return got, time.monotonic() - t0, (donor_bw.upload if upload else pacer).total
        finally:
            for p in (donor, receiver):
                await p.shutdown()

    capped = (rate, 0.0) if side == "donor's upload" else (0.0, rate)
    got, seconds, paced = run_async(fetch(*capped))
    assert got.digest == snap.digest and torch.equal(got.v, v)
    nbytes = paced  # the chunks' serialized sizes, counted by the capped pacer
    assert 8 * numel <= nbytes < 8.01 * numel
    assert seconds >= nbytes / rate - BURST_S, (seconds, nbytes / rate)
    [(sampled, took)] = samples
    assert sampled == nbytes and sampled / took <= rate * 1.1, (sampled, took)
