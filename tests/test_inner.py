"""Tests for peer/local/inner.py: LR schedule, weight-decay groups, InnerLoop behaviour."""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

from peer.local.markov import MarkovSource
from peer.local.inner import InnerLoop, compile_wanted, lr_at, split_decay_params
from peer.local.model import build_model

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _loop(model, **overrides) -> InnerLoop:
    kwargs = dict(
        lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=10, total_steps=150,
        min_lr_ratio=0.1, grad_clip=1.0, z_loss=1e-4, device=CPU,
    )
    kwargs.update(overrides)
    return InnerLoop(model, **kwargs)


def _tiny(seed: int = 0, vocab: int = 256):
    torch.manual_seed(seed)
    model, _ = build_model("tiny", vocab, 64)
    return model


# --- schedule ---

def test_lr_schedule_values():
    kw = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)  # first step already moves
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == pytest.approx(1.0)  # end of warmup = peak
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)  # cosine midpoint: (peak + floor) / 2
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(10_000, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


def test_lr_schedule_edge_cases():
    assert lr_at(0, lr=2.0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == pytest.approx(2.0)
    assert lr_at(10, lr=2.0, warmup_steps=0, total_steps=10, min_lr_ratio=0.0) == pytest.approx(0.0)
    assert lr_at(7, lr=2.0, warmup_steps=5, total_steps=5, min_lr_ratio=0.5) == pytest.approx(1.0)
    bad_args = (
        dict(warmup_steps=20, total_steps=10, min_lr_ratio=0.1),
        dict(warmup_steps=1, total_steps=10, min_lr_ratio=1.5),
    )
    for bad in bad_args:
        with pytest.raises(ValueError):
            lr_at(0, lr=1.0, **bad)


# --- optimizer groups ---

def test_weight_decay_excludes_norms_and_embedding():
    model = _tiny()
    decay, no_decay = split_decay_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay}
    assert "tok_emb.weight" in no_decay_names and "final_norm.weight" in no_decay_names
    assert all(p.ndim == 2 for p in decay) and "tok_emb.weight" not in {names[id(p)] for p in decay}
    assert any(n.endswith("q_norm.weight") for n in no_decay_names)
    # A partition: every parameter exactly once.
    assert sorted(map(id, decay + no_decay)) == sorted(names)
    assert len(decay) == 6 * 4  # qkv, out, up, down per block


# --- InnerLoop ---

def test_step_updates_params_and_reports_stats():
    model = _tiny()
    loop = _loop(model)
    before = copy.deepcopy(model.state_dict())
    batch = MarkovSource(256, seed=0).next_batch(4, 16)
    stats = loop.step(batch)
    assert loop.step_count == 1 and stats.tokens == 4 * 16
    assert stats.lr == pytest.approx(lr_at(0, lr=3e-3, warmup_steps=10, total_steps=150, min_lr_ratio=0.1))
    assert math.isfinite(stats.grad_norm) and stats.grad_norm > 0
    assert stats.loss > stats.ce > 0 and abs(stats.ce - math.log(256)) < 0.3
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)


def test_grad_clip_bounds_the_applied_gradient():
    model = _tiny()
    loop = _loop(model, grad_clip=1e-3)
    stats = loop.step(MarkovSource(256, seed=0).next_batch(4, 16))
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert stats.grad_norm > 1e-3 and clipped.item() <= 1e-3 * 1.001


def test_non_finite_loss_raises_and_leaves_params_untouched():
    model = _tiny()
    loop = _loop(model)
    with torch.no_grad():
        model.blocks[0].mlp.up.weight[0, 0] = float("nan")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(FloatingPointError, match="loss is nan"):
        loop.step(MarkovSource(256, seed=0).next_batch(2, 8))
    assert loop.step_count == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v.nan_to_num(), before[k].nan_to_num()), k


def test_deferred_checks_skip_a_non_finite_update_and_raise_when_read():
    """Deferred checks (the CUDA default; fused AdamW on the CPU here): the bad step and every later one leave
    the parameters and the optimizer state as they were, and reading any of their stats, or check_finite,
    raises naming the bad step. No step itself raises (no wait for the device)."""
    model = _tiny()
    loop = _loop(model, defer_checks=True)
    src = MarkovSource(256, seed=0)
    good = loop.step(src.next_batch(2, 8))
    assert math.isfinite(good.ce) and good.ce > 0
    with torch.no_grad():
        model.blocks[0].mlp.up.weight[0, 0] = float("nan")
    params = copy.deepcopy(model.state_dict())
    optimizer = copy.deepcopy(loop.optimizer.state_dict()["state"])
    bad = loop.step(src.next_batch(2, 8))
    later = loop.step(src.next_batch(2, 8))
    assert loop.step_count == 3  # the steps were taken (on the device), only their updates were skipped
    for k, v in model.state_dict().items():
        assert torch.equal(v.nan_to_num(), params[k].nan_to_num()), k
    for i, state in loop.optimizer.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, optimizer[i][name]), (i, name)
    for stats in (later, bad):
        with pytest.raises(FloatingPointError, match="inner step 1: loss is nan"):
            stats.ce
    with pytest.raises(FloatingPointError, match="inner step 1: loss is nan"):
        loop.check_finite()
    assert good.loss > good.ce  # resolved before: stays readable


def test_deferred_checks_give_the_eager_steps():
    """Where every step is finite, deferring the checks (fused AdamW) changes nothing beyond float rounding."""
    batches = [MarkovSource(256, seed=2).next_batch(4, 16) for _ in range(4)]
    eager, deferred = _tiny(seed=1), _tiny(seed=1)
    eager_loop, deferred_loop = _loop(eager), _loop(deferred, defer_checks=True)
    for b in batches:
        a, c = eager_loop.step(b), deferred_loop.step(b)
        assert (c.loss, c.ce, c.grad_norm) == pytest.approx((a.loss, a.ce, a.grad_norm), rel=1e-4)
    deferred_loop.check_finite()
    for (name, p), q in zip(eager.named_parameters(), deferred.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/gpu.py runs it on one)")
def test_cuda_inner_step_does_not_wait_for_the_device():
    """On CUDA a step (bf16 autocast, fused AdamW, deferred checks) makes no synchronizing call: torch's sync
    debug mode turns any into an error. Reading the stats afterwards is the one wait."""
    torch.manual_seed(0)
    model, _ = build_model("tiny", 256, 64)
    cuda = torch.device("cuda")
    loop = _loop(model.to(cuda), device=cuda)
    src = MarkovSource(256, seed=0)
    batches = [src.next_batch(4, 16).pin_memory() for _ in range(3)]
    loop.step(batches[0])  # the first step allocates the optimizer state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = [loop.step(b) for b in batches[1:]]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(math.isfinite(s.ce) for s in stats)


@pytest.mark.parametrize("micro_batch", [1, 4, 3])
def test_gradient_accumulation_gives_the_whole_batch_update(micro_batch):
    """6 sequences in micro-batches of 1, 4 (a remainder of 2) or 3: the same stats and the same (clipped)
    gradients as one pass over the batch, within float summation tolerance. (Gradients, not weights: Adam
    divides by |g|, so elements with a near-zero gradient turn summation noise into lr-sized moves.)"""
    batches = [MarkovSource(256, seed=4).next_batch(6, 16) for _ in range(3)]
    whole, split = _tiny(seed=5), _tiny(seed=5)
    whole_loop, split_loop = _loop(whole), _loop(split, micro_batch=micro_batch)
    for b in batches:
        split.load_state_dict(whole.state_dict())  # the same weights before each step
        a, c = whole_loop.step(b), split_loop.step(b)
        assert (a.tokens, a.lr) == (c.tokens, c.lr)
        assert c.loss == pytest.approx(a.loss, rel=1e-5) and c.ce == pytest.approx(a.ce, rel=1e-5)
        assert c.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        for (name, p), q in zip(whole.named_parameters(), split.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_micro_batch_is_checked():
    with pytest.raises(ValueError, match="micro_batch"):
        _loop(_tiny(), micro_batch=-1)


def _compile_unavailable() -> str:
    """Why torch.compile cannot run here ('' where it can): inductor builds C++ kernels on the CPU."""
    import shutil

    if not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python/torch"
    if not (shutil.which("g++") or shutil.which("c++")):
        return "no C++ compiler for inductor's CPU kernels"
    return ""


@pytest.mark.skipif(bool(_compile_unavailable()), reason=_compile_unavailable() or "-")
def test_compiled_inner_steps_match_the_eager_ones_and_keep_the_weights_names():
    """inner.compile: the compiled forward/backward give the eager steps within float tolerance (inductor fuses
    differently), and the loop's model, its state_dict and its parameters stay the uncompiled module's (no
    ``_orig_mod.`` prefix in checkpoints or fragments). About 30-60 s on a 2-core CPU, most of it compiling.
    Gradients are compared from the same weights at every step, not weights after steps: Adam divides by |g|,
    so an element whose gradient is near zero turns summation noise into an lr-sized move (after a few steps one
    weight can be out of any tolerance)."""
    torch._dynamo.reset()
    batches = [MarkovSource(256, seed=6).next_batch(4, 16) for _ in range(3)]
    eager, compiled = _tiny(seed=2), _tiny(seed=2)
    keys = list(compiled.state_dict())
    eager_loop, compiled_loop = _loop(eager), _loop(compiled, compile=True)
    assert compiled_loop.model is compiled and list(compiled_loop.model.state_dict()) == keys
    assert compiled_loop.params == split_decay_params(compiled)[0] + split_decay_params(compiled)[1]
    for b in batches:
        compiled.load_state_dict(eager.state_dict())  # the same weights before each step (copied in place)
        a, c = eager_loop.step(b), compiled_loop.step(b)
        assert (c.loss, c.ce, c.grad_norm) == pytest.approx((a.loss, a.ce, a.grad_norm), rel=1e-4)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert list(compiled.state_dict()) == keys
    torch._dynamo.reset()


def test_state_dict_resume_is_exact():
    src = MarkovSource(256, seed=1)
    batches = [src.next_batch(4, 16) for _ in range(6)]
    model = _tiny(seed=3)
    loop = _loop(model)
    for b in batches[:3]:
        loop.step(b)
    model_state = copy.deepcopy(model.state_dict())
    loop_state = copy.deepcopy(loop.state_dict())
    for b in batches[3:]:
        loop.step(b)

    resumed_model = _tiny(seed=99)
    resumed_model.load_state_dict(model_state)
    resumed = _loop(resumed_model)
    resumed.load_state_dict(loop_state)
    assert resumed.step_count == 3
    for b in batches[3:]:
        resumed.step(b)
    for k, v in model.state_dict().items():
        assert torch.equal(v, resumed_model.state_dict()[k]), k


def test_tiny_model_learns_markov_source():
    # 150 steps of 8x32 tokens: CE drops from ~log(256)=5.55 to ~3.4 (floor ~2.1) on every
    # seed tried (0..5); the asserted margins leave ~0.7 nats of slack.
    model = _tiny(seed=0)
    src = MarkovSource(256, seed=0)
    loop = _loop(model)
    ces = [loop.step(src.next_batch(8, 32)).ce for _ in range(150)]
    initial, final = ces[0], sum(ces[-10:]) / 10
    assert initial > 5.0
    assert final < initial - 1.5
    assert final < src.entropy_floor + 1.75


def test_the_8bit_optimizer_learns_resumes_exactly_through_a_checkpoint_and_refuses_deferred_checks(tmp_path):
    """inner.optimizer = adamw8bit (torchao's AdamW8bit): its moments take a byte per value, the loss falls, the
    state goes through our checkpoint file (``torch.load(weights_only=True)``) and the resumed steps give the same
    bits; a non-finite step raises at once, its weights untouched (no deferred checks: it has no found_inf)."""
    from peer.run import checkpoint

    src = MarkovSource(256, seed=2)
    batches = [src.next_batch(8, 32) for _ in range(40)]
    model = _tiny(seed=4)
    loop = _loop(model, optimizer="adamw8bit")
    first = loop.step(batches[0]).ce
    for b in batches[1:30]:
        loop.step(b)
    moments = [t for state in loop.optimizer.state.values() for k, t in state.items() if k.startswith("exp_avg")]
    big = max(model.parameters(), key=lambda p: p.numel())
    assert any(t.numel() == big.numel() for t in moments)
    quantized = sum(1 for t in moments if type(t).__name__ == "OptimState8bit")
    assert quantized >= 2, [type(t).__name__ for t in moments]  # (parameters under 4096 values keep fp32 moments)
    assert loop.step(batches[30]).ce < first - 0.5

    checkpoint.save(tmp_path, 31, {"model": model.state_dict(), "inner": loop.state_dict()})
    for b in batches[31:]:
        loop.step(b)
    _, saved = checkpoint.load_latest(tmp_path)
    resumed_model = _tiny(seed=99)
    resumed_model.load_state_dict(saved["model"])
    resumed = _loop(resumed_model, optimizer="adamw8bit")
    resumed.load_state_dict(saved["inner"])
    for b in batches[31:]:
        resumed.step(b)
    for k, v in model.state_dict().items():
        assert torch.equal(v, resumed_model.state_dict()[k]), k

    with torch.no_grad():
        model.blocks[0].mlp.up.weight[0, 0] = float("nan")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(FloatingPointError, match="loss is nan"):
        loop.step(batches[0])
    for k, v in model.state_dict().items():
        assert torch.equal(v.nan_to_num(), before[k].nan_to_num()), k
    with pytest.raises(ValueError, match="defer_checks"):
        _loop(_tiny(), optimizer="adamw8bit", defer_checks=True)


def test_compile_wanted_follows_the_choice_and_auto_wants_cuda_with_triton(monkeypatch):
    """inner.compile: on and off are followed on any device; auto compiles on CUDA only, and only where Triton (the
    GPU kernels' compiler) is installed and supports the card, so a card without it trains eagerly instead of
    failing at its first step."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_wanted("on", cpu) and not compile_wanted("off", cuda)
    assert not compile_wanted("auto", cpu)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not compile_wanted("auto", cuda)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert compile_wanted("auto", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))  # (a GTX 1080)
    assert not compile_wanted("auto", cuda) and compile_wanted("on", cuda)
