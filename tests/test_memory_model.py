"""The memory model of an inner step (peer/local/memory.py) against what an inner step allocates, and the doctor's
memory check built on it."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from peer.config import ConfigError, PeerConfig
from peer.local import memory
from peer.local.inner import InnerLoop
from peer.local.markov import MarkovSource
from peer.local.model import PRESETS, build_model, count_parameters
from peer.run.doctor import CheckVerdict, _memory

INNER = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=10, total_steps=100, min_lr_ratio=0.1,
             grad_clip=1.0, z_loss=1e-4)


class PeakBytes(TorchDispatchMode):
    """The peak bytes of the CPU storages alive while it is active: those of ``tensors`` and every storage an op
    returns, each counted once until it is freed."""

    def __init__(self, tensors):
        super().__init__()
        self.live: set[int] = set()
        self.now = self.peak = 0
        for t in tensors:
            self._note(t)

    def _freed(self, key: int, nbytes: int) -> None:
        self.live.discard(key)
        self.now -= nbytes

    def _note(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        if id(storage) in self.live or storage.nbytes() == 0:
            return
        self.live.add(id(storage))
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._freed, id(storage), storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._note(t)
        return out


def measured_peak(setting: memory.Setting) -> int:
    """The peak bytes of the second inner step of ``setting`` on the CPU (the first allocates AdamW's moments)."""
    torch.manual_seed(0)
    model, _ = build_model(setting.preset, setting.vocab_size, setting.seq_len,
                           activation_checkpointing=setting.activation_checkpointing)
    inner = InnerLoop(model, device="cpu", micro_batch=setting.micro_batch, **INNER)
    batch = MarkovSource(setting.vocab_size, seed=1).next_batch(setting.batch_size, setting.seq_len)
    inner.step(batch)
    held = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    held += [t for state in inner.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    tracker = PeakBytes(held)
    del held  # (a reference here would keep the gradients the step frees alive)
    with tracker:
        inner.step(batch)
    return tracker.peak


@pytest.mark.parametrize("preset,vocab,seq_len,batch", [("tiny", 1024, 128, 8), ("small", 2048, 64, 4)])
def test_the_cpu_estimate_is_within_a_tenth_of_what_an_inner_step_allocates(preset, vocab, seq_len, batch):
    """Every setting's estimate (whole batch or two-sequence chunks, with and without activation checkpointing)
    against the peak of the storages the step allocated; the activations dominate at these sizes."""
    for micro in (0, 2):
        for checkpointing in (False, True):
            setting = memory.Setting(preset=preset, vocab_size=vocab, seq_len=seq_len, batch_size=batch,
                                     micro_batch=micro, activation_checkpointing=checkpointing)
            guess, peak = memory.estimate(setting, memory.CPU).total, measured_peak(setting)
            assert abs(guess / peak - 1) < 0.1, (setting.describe(), guess, peak)


def test_the_parameter_count_is_the_models():
    for name, shape in PRESETS.items():
        with torch.device("meta"):
            model, _ = build_model(name, 32000, 1024)
        assert memory.parameters(shape, 32000) == count_parameters(model), name


def test_ways_to_fit_keep_within_the_budget_and_try_the_whole_batch_first():
    base = memory.Setting(preset="500M", vocab_size=32000, seq_len=1024, batch_size=8)
    budget = 16 * memory.GIB
    options = list(memory.ways_to_fit(base, budget))
    assert options and all(guess.total <= budget for _, guess in options)
    assert options[0][0].micro_batch == 0  # a whole batch fits (with checkpointing): no micro-batching needed
    assert memory.estimate(base).total > budget  # ... but not without
    # checkpointing and micro-batching only shrink the estimate; the device path only grows it
    whole = memory.estimate(base).total
    assert memory.estimate(dataclasses.replace(base, activation_checkpointing=True)).total < whole
    assert memory.estimate(dataclasses.replace(base, micro_batch=2)).total < whole
    assert memory.estimate(dataclasses.replace(base, state_on_device=True)).total > whole


def test_a_rolling_residency_costs_the_largest_fragments_in_flight():
    """The rolling residency's copies: ``rolling_copies`` of the largest fragment (its blocks and the embedding, as
    :func:`~peer.outer.fragments.partition` makes it), between none and every fragment's."""
    from peer.outer.fragments import partition

    for name in ("100M", "1B"):
        with torch.device("meta"):
            model, blocks = build_model(name, 32000, 1024)
        largest = max(f.numel for f in partition(model, blocks, 3, "strided"))
        assert abs(memory.largest_fragment(memory.PRESETS[name], 32000, 3) - largest) <= 4096, name
    base = memory.Setting(preset="1B", vocab_size=32000, seq_len=1024, batch_size=8, activation_checkpointing=True,
                          optimizer="adamw8bit")
    on, rolling = (memory.estimate(dataclasses.replace(base, state_on_device=kind)).outer_state
                   for kind in (True, "rolling"))
    assert 0 < rolling == 8 * 3 * memory.largest_fragment(memory.PRESETS["1B"], 32000, 3) < on
    # the 1B preset on a 24 GiB card: launches that only enqueue work, with the rolling residency
    option, guess = next(memory.ways_to_fit(base, int(memory.HEADROOM * 24 * memory.GIB)))
    assert option.state_on_device == "rolling" and guess.total < 24 * memory.GIB
    assert PeerConfig.from_dict({"outer": {"state_on_device": "rolling"}}).outer.state_on_device == "rolling"
    with pytest.raises(ConfigError, match="auto, on, rolling or off"):
        PeerConfig.from_dict({"outer": {"state_on_device": "half"}})


def config(**model) -> PeerConfig:
    return PeerConfig.from_dict({"model": {"preset": "500M", "seq_len": 1024, **model},
                                 "data": {"vocab_size": 32000, "batch_size": 8}})


def test_the_doctor_says_which_setting_or_preset_fits_the_card():
    ok = _memory(config(activation_checkpointing=True), budget=16 * memory.GIB, on_cuda=True)
    assert ok.verdict is CheckVerdict.OK and "500M" in ok.found and "16.0 GiB of the card's" in ok.found, ok
    tight = _memory(config(), budget=16 * memory.GIB, on_cuda=True)
    assert tight.verdict is CheckVerdict.FAIL and "activation checkpointing" in tight.fix, tight
    card24 = _memory(config(preset="1B"), budget=24 * memory.GIB, on_cuda=True)
    assert card24.verdict is CheckVerdict.FAIL and "8-bit AdamW" in card24.fix, card24  # (22.2 GiB at best without)
    none = _memory(config(preset="1B"), budget=8 * memory.GIB, on_cuda=True)
    assert none.verdict is CheckVerdict.FAIL and "no setting of this preset fits" in none.fix, none
    assert "1B" not in none.fix and "100M" in none.fix, none
    own = _memory(config(factory="mine:build"), budget=memory.GIB, on_cuda=True)
    assert own.verdict is CheckVerdict.OK and "not estimated" in own.found
