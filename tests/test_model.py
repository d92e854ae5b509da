"""Tests for peer/local/model.py: shapes, presets, causality, QK-norm/RoPE, z-loss, factories."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from peer.local import model as model_mod
from peer.local.model import PRESETS, ModelShape, Transformer, build_model, count_parameters, lm_loss

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiny(seed: int = 0, max_seq_len: int = 64) -> Transformer:
    torch.manual_seed(seed)
    model, _ = build_model("tiny", VOCAB, max_seq_len)
    return model.eval()


# --- a user model for the factory plug-in (imported by name through __name__) ---

class _ToyLM(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def toy_factory(vocab_size: int, max_seq_len: int):
    model = _ToyLM(vocab_size)
    return model, list(model.layers)


def foreign_blocks_factory(vocab_size: int, max_seq_len: int):
    return _ToyLM(vocab_size), [nn.Linear(8, 8)]


def empty_blocks_factory(vocab_size: int, max_seq_len: int):
    return _ToyLM(vocab_size), []


def not_a_pair_factory(vocab_size: int, max_seq_len: int):
    return _ToyLM(vocab_size)


NOT_CALLABLE = 3


# --- presets and parameter counts ---

def test_tiny_and_small_presets_are_cpu_sized():
    assert PRESETS["tiny"].n_layers == 6
    for name, lo, hi in (("tiny", 1.0e6, 2.0e6), ("small", 4.0e6, 6.5e6)):
        with torch.device("meta"):
            model, blocks = build_model(name, VOCAB, 256)
        assert lo <= count_parameters(model) <= hi, name
        assert len(blocks) == PRESETS[name].n_layers


@pytest.mark.parametrize("name", ["35M", "100M", "200M", "300M", "500M", "1B"])
def test_paper_presets_match_their_names(name):
    nominal = float(name[:-1]) * (1e9 if name.endswith("B") else 1e6)
    with torch.device("meta"):  # no memory is allocated, even for 1B
        model, blocks = build_model(name, 32000, 1024)
    n = count_parameters(model)
    assert 0.65 * nominal <= n <= 1.35 * nominal, (name, n)
    assert [b for b in model.blocks] == blocks


def test_count_parameters_counts_tied_weights_once():
    model = _tiny()
    s = PRESETS["tiny"]
    per_block = 12 * s.d_model**2 + 2 * s.d_model + 2 * s.head_dim  # weights + 2 norms + qk norms
    expected = VOCAB * s.d_model + s.n_layers * per_block + s.d_model
    assert count_parameters(model) == expected
    # The LM head is the embedding: no separate head parameter exists.
    assert sum(1 for n, _ in model.named_parameters() if "emb" in n) == 1


def test_model_shape_validation():
    with pytest.raises(ValueError):
        ModelShape(2, 100, 3, 64)  # 100 is not divisible by 3
    with pytest.raises(ValueError):
        ModelShape(2, 12, 4, 64)  # head dim 3 is odd: RoPE needs pairs


# --- forward behaviour ---

def test_forward_shape_dtype_and_init_determinism():
    a, b = _tiny(seed=1), _tiny(seed=1)
    tokens = torch.randint(0, VOCAB, (3, 17))
    out = a(tokens)
    assert out.shape == (3, 17, VOCAB) and out.dtype == torch.float32
    assert torch.equal(out, b(tokens))
    assert not torch.equal(a.tok_emb.weight, _tiny(seed=2).tok_emb.weight)
    # Fresh model: near-uniform predictions, so CE is close to log(V).
    _, ce = lm_loss(out[:, :-1], tokens[:, 1:])
    assert abs(ce.item() - math.log(VOCAB)) < 0.3


def test_too_long_sequence_raises():
    with pytest.raises(ValueError, match="max_seq_len"):
        _tiny(max_seq_len=8)(torch.zeros(1, 9, dtype=torch.long))


def test_causal_masking():
    model = _tiny()
    tokens = torch.randint(0, VOCAB, (2, 24))
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-5)
    assert (a[:, 12:] - b[:, 12:]).abs().amax() > 1e-3


def _one_layer(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelShape(1, 64, 2, 128), VOCAB, 32).eval()


def test_rotary_makes_outputs_position_dependent(monkeypatch):
    # In a 1-layer causal model the last position attends to the prefix as a set, so
    # swapping two earlier tokens changes its output only through position encoding.
    model = _one_layer()
    tokens = torch.randint(0, VOCAB, (1, 10))
    tokens[0, 0], tokens[0, 1] = 5, 9
    swapped = tokens.clone()
    swapped[0, 0], swapped[0, 1] = 9, 5
    with torch.no_grad():
        assert (model(tokens)[0, -1] - model(swapped)[0, -1]).abs().amax() > 1e-4
        monkeypatch.setattr(model_mod, "_apply_rope", lambda x, cos, sin: x)
        torch.testing.assert_close(model(tokens)[0, -1], model(swapped)[0, -1], rtol=0, atol=1e-5)


def test_qk_norm_makes_attention_invariant_to_qk_scale():
    model = _tiny()
    tokens = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        before = model(tokens)
        d = model.shape.d_model
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * d] *= 10.0  # scale queries and keys only
        after = model(tokens)
        torch.testing.assert_close(before, after, rtol=1e-4, atol=1e-4)
        model.blocks[0].attn.qkv.weight[2 * d :] *= 10.0  # values are not normalised
        assert (model(tokens) - before).abs().amax() > 1e-3


# --- loss ---

def test_lm_loss_matches_hand_computation():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11) * 3
    targets = torch.randint(0, 11, (2, 5))
    total, ce = lm_loss(logits, targets, z_loss=0.01)
    flat, tgt = logits.reshape(-1, 11).double(), targets.reshape(-1)
    log_z = flat.exp().sum(-1).log()
    hand_ce = (log_z - flat[torch.arange(10), tgt]).mean()
    hand_total = hand_ce + 0.01 * (log_z**2).mean()
    assert abs(ce.item() - hand_ce.item()) < 1e-5
    assert abs(total.item() - hand_total.item()) < 1e-5
    total0, ce0 = lm_loss(logits, targets, z_loss=0.0)
    assert total0.item() == ce0.item() == ce.item()


def test_lm_loss_accepts_bf16_logits():
    logits = torch.randn(4, 7, dtype=torch.bfloat16)
    total, ce = lm_loss(logits, torch.zeros(4, dtype=torch.long))
    assert total.dtype == ce.dtype == torch.float32 and total.item() > ce.item()


# --- build_model and factories ---

def test_bad_preset_raises():
    with pytest.raises(ValueError, match="unknown model preset"):
        build_model("huge", VOCAB, 64)


def test_factory_plugin():
    model, blocks = build_model("ignored", 50, 16, factory=f"{__name__}:toy_factory")
    assert isinstance(model, _ToyLM) and blocks == list(model.layers)
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 50)


@pytest.mark.parametrize(
    "factory",
    [
        "no_colon_here",
        ":toy_factory",
        f"{__name__}:",
        "a:b:c",
        "no_such_module_swarmloco_xyz:make",
        f"{__name__}:missing_function",
        f"{__name__}:NOT_CALLABLE",
        f"{__name__}:foreign_blocks_factory",
        f"{__name__}:empty_blocks_factory",
        f"{__name__}:not_a_pair_factory",
    ],
)
def test_bad_factory_raises(factory):
    with pytest.raises(ValueError, match="model factory"):
        build_model("tiny", VOCAB, 64, factory=factory)


def test_training_signal_flows_to_every_parameter():
    model = _tiny().train()
    tokens = torch.randint(0, VOCAB, (2, 9))
    loss, _ = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
