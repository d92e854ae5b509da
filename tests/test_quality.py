"""A short version of bench/quality.py's ablation: every method of issue 7, checked for robust facts only.

Every method (data-parallel, DiLoCo, Streaming DiLoCo fp32 / FP4 / FP4 + error feedback, overlap tau 1 and 5 with
the alpha and the replay merge, the full method, tau = H eager and naive, sequential fragments, heterogeneous tau)
trains a 4-block model (``mini_model`` below: the tiny preset's shape at half width and two thirds of the depth,
so fragments of 2 blocks give P = 2 like tiny's 3) on M = 2 simulated replicas for 96 steps, in one process.
The checks: every method's held-out loss falls well below the start (naive delayed application at tau = H with the
full outer lr, which barely learns, must instead lose clearly to eager), FP4 and fp32 end within a tolerance taken
from the measured noise band, and no loss or weight is NaN anywhere.
About 35 s on a 2-core machine (two worker processes).

The full bench (tiny preset, M = 4, two seeds, a loopback swarm) is ``bench/quality.py``; its results are in
docs/benchmarks.md.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from peer.local.model import ModelShape, Transformer
from peer.outer.schedule import rounds_due_by

REPO = Path(__file__).resolve().parents[1]
# bench/ on the path (not a package): the workers that run_all spawns inherit sys.path and import it by name
sys.path.insert(0, str(REPO / "bench"))
import quality  # noqa: E402

SEED = 0
# The start is the initial model's held-out loss, ~log(64) = 4.18 nats; the entropy floor is 2.11. After 96 steps
# the methods ended at 2.85-3.30 (every method with seed 0; DiLoCo, data-parallel and the tau = H ones also with
# seeds 1-2; data-parallel best, tau = H worst), so 0.5 nats below the start is far inside what all of them reach
# and far outside what a broken outer step (weights reset every round, NaN) gives. The exception is naive delayed
# application at tau = H with the full outer lr 0.7: it ended at 3.83-4.06 (it oscillates; the eager paper lowers
# its outer lr 4x for this reason), so it is checked against eager instead.
MIN_DROP = 0.5
UNSTABLE = "tauH_naive"
# Noise band of this configuration, measured with bench/quality.py's run_one on seeds 0-4 (2026-11-21): the final
# eval CE of Streaming fp32 spread over 0.13 nats between seeds (2.922-3.054, std 0.05); the paired FP4 - fp32
# difference of the same seed (same init and data) was within [-0.013, +0.022], with error feedback
# [-0.011, +0.031]. The tolerance, 0.06 nats, is half the seed band and twice the largest paired difference seen:
# FP4 fails only when it costs as much as a good part of a change of seed does.
FP4_TOLERANCE = 0.06
# tau = H, seeds 0-2: eager 3.14-3.25, naive delayed at outer lr 0.7 3.83-4.06; a gap of >= 0.69 nats, 5x the seed
# band. Required here: 0.3.
EAGER_MARGIN = 0.3


def mini_model(vocab_size: int, max_seq_len: int):
    """Model factory (``test_quality:mini_model``): 4 blocks of width 64, ~0.2M parameters at vocab 64."""
    model = Transformer(ModelShape(4, 64, 2, 256, "test_quality"), vocab_size, max_seq_len)
    return model, list(model.blocks)


SETUP = quality.Setup(replicas=2, factory="test_quality:mini_model", fragment_blocks=2, seq_len=16, batch_size=4,
                      H=10, rounds=9, tail=6, inner_lr=3e-3, warmup_steps=10, vocab_size=64, eval_seqs=64,
                      curve_seqs=16)


@pytest.fixture(scope="module")
def results() -> dict[str, "quality.RunResult"]:
    previous = torch.get_num_threads()
    try:
        # two single-threaded workers: the methods are independent (35 s instead of 52 on 2 cores)
        runs = quality.run_all(quality.METHODS, SETUP, [SEED], jobs=2, log=lambda *a: None)
    finally:
        torch.set_num_threads(previous)
    return {r.method: r for r in runs}


def test_every_method_runs_and_learns(results):
    assert sorted(results) == sorted(m.key for m in quality.METHODS)
    floor = quality.MarkovSource(64, SETUP.data_seed).entropy_floor
    for key, r in results.items():
        start = r.eval_ce[0]
        assert start > 3.9, (key, start)  # ~log(64): nothing learned yet
        assert r.final > floor - 0.05, (key, r.final, floor)
        if key != UNSTABLE:
            assert r.final < start - MIN_DROP, f"{key}: held-out CE {start:.3f} -> {r.final:.3f}"
    # the eager paper's Table 2 comparison: at tau = H eager is clearly better than naive delayed application
    assert results["tauH_eager"].final < results[UNSTABLE].final - EAGER_MARGIN, \
        (results["tauH_eager"].final, results[UNSTABLE].final)
    # the outer methods synced: every round of every fragment went through the transport
    for key, r in results.items():
        method = quality.BY_KEY[key]
        if not method.dp:
            P = 1 if method.blocks_per_fragment(SETUP) == 0 else 2
            assert r.rounds == sum(rounds_due_by(SETUP.steps, p, P, SETUP.H) for p in range(P)), (key, r.rounds)


def test_no_nan_anywhere(results):
    for key, r in results.items():
        assert r.finite and not r.error, (key, r.error)
        assert all(math.isfinite(x) for x in r.eval_ce), (key, r.eval_ce)
        assert all(math.isfinite(x) for x in r.train_ce[1:]), (key, r.train_ce)  # [0]: no steps yet
        assert math.isfinite(r.final) and math.isfinite(r.final_replica0), key
        assert quality.BY_KEY[key].dp or math.isfinite(r.final_shared), key  # (data-parallel has no shared G)


def test_the_shared_model_is_every_fragments_G_in_place_of_the_local_weights():
    """``shared_ce`` evaluates the fragments' ``G`` through the peer's own mapping (peer.run.evaluation): equal to
    the model's own CE while its weights are ``G``, unchanged (and the model untouched) once they move away."""
    model, blocks = mini_model(64, 32)
    fragments = quality.partition(model, blocks, 2)
    transport = quality.FakeTransport(1)
    engine = quality.StreamingEngine(fragments, quality.OuterSettings(H=10), transport.endpoint(0))
    try:
        batch = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
        before = quality.evaluate(model, batch)
        assert quality.shared_ce(model, engine, batch) == before
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        moved = [p.detach().clone() for p in model.parameters()]
        assert quality.evaluate(model, batch) != before
        assert quality.shared_ce(model, engine, batch) == before
        assert all(torch.equal(a, b) for a, b in zip(moved, model.parameters()))
    finally:
        engine.close()


def test_fp4_ends_within_the_noise_band_of_fp32(results):
    fp32 = results["streaming"].final
    for key in ("fp4", "fp4_ef"):
        assert abs(results[key].final - fp32) < FP4_TOLERANCE, (key, results[key].final, fp32)
    # and it is 7x smaller on the wire (4.5 bits per element + per-message headers)
    ratio = results["streaming"].bytes_per_peer / results["fp4"].bytes_per_peer
    assert 6.5 < ratio < 32 / 4.5 + 0.01, ratio


def test_table_and_plot(results, tmp_path):
    floor = quality.MarkovSource(64, SETUP.data_seed).entropy_floor
    rows = quality.summarize(list(results.values()), floor)
    table = quality.format_table(rows, floor)
    assert table.count("\n| ") == len(quality.METHODS) + 1  # the header and one row per method
    pytest.importorskip("matplotlib")
    assert quality.plot(list(results.values()), floor, tmp_path / "quality.png")
    assert (tmp_path / "quality.png").stat().st_size > 10_000
