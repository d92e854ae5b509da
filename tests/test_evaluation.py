"""The shared model on held-out data (peer/run/evaluation.py, ``TokenSource.held_out``): pure, no network. The swarm
case (every peer reports the same loss for the same parameters, and ``swarm-peer eval``) is in tests/test_swarm.py's
three-peer test."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from peer.local.data import BinShardSource, TextFileSource
from peer.local.markov import MarkovSource
from peer.local.inner import mean_ce
from peer.local.model import build_model
from peer.outer.fragments import partition
from peer.run.evaluation import SharedEval, shared_params


def test_held_out_tokens_are_never_trained_on_and_are_the_same_for_every_shard(tmp_path):
    """A corpus whose token i is i: the training windows of any shard, over more than a whole pass, hold only
    tokens of the first 90%; the held-out windows only tokens of the last 10%, the same for every shard."""
    path = tmp_path / "tokens.bin"
    np.arange(2000, dtype="<u2").tofile(path)
    sources = [BinShardSource([str(path)], 4096, seed=3, shard_index=s, holdout=0.1) for s in range(3)]
    assert sources[0].num_tokens == 1800 and sources[0].held_tokens == 200
    for src in sources:
        for _ in range(30):  # 30 x 4 x 16 tokens: more than one pass over 1800
            assert int(src.next_batch(4, 16).max()) < 1800
    held = [src.held_out(64, 16) for src in sources]
    assert held[0] is not None and held[0].shape == (12, 17)  # (200 - 1) // 16 windows fit
    assert all(torch.equal(h, held[0]) for h in held) and int(held[0].min()) == 1800
    assert torch.equal(held[0][:, 0], torch.arange(1800, 1800 + 12 * 16, 16))  # consecutive windows
    # too little held out for one sequence, or nothing: no held-out data (the peer says it will not evaluate)
    assert BinShardSource([str(path)], 4096, seed=3, holdout=0.005).held_out(8, 16) is None
    assert BinShardSource([str(path)], 4096, seed=3).held_out(8, 16) is None
    with pytest.raises(ValueError, match="holdout"):
        BinShardSource([str(path)], 4096, seed=3, holdout=1.0)
    # a checkpointed cursor of other held-out settings is refused, naming it
    text = tmp_path / "a.txt"
    text.write_text("hello world " * 50)
    with pytest.raises(ValueError, match="data.holdout"):
        TextFileSource([str(text)], 1, holdout=0.1).load_state_dict(TextFileSource([str(text)], 1).state_dict())


def test_the_synthetic_held_out_stream_is_one_for_every_shard_and_apart_from_training():
    a, b = MarkovSource(64, 7, 0), MarkovSource(64, 7, 5)
    held = a.held_out(8, 32)
    assert torch.equal(held, b.held_out(8, 32)) and torch.equal(held, a.held_out(8, 32))
    assert not any(torch.equal(held, src.next_batch(8, 32)) for src in (a, b) for _ in range(3))
    assert a.state_dict()["batches_served"] == 3  # evaluation moves no cursor
    assert not torch.equal(held, MarkovSource(64, 8, 0).held_out(8, 32))  # another run, another corpus


def _tiny():
    torch.manual_seed(0)
    model, blocks = build_model("tiny", 64, 16)
    return model, partition(model, blocks, 3)


def test_the_shared_parameters_evaluate_as_the_model_holding_them_and_leave_it_untouched():
    model, fragments = _tiny()
    own = {k: v.clone() for k, v in model.state_dict().items()}
    G = [f.flat() + 0.01 * torch.randn(f.numel) for f in fragments]
    batch = MarkovSource(64, 1).held_out(6, 16)
    shared = mean_ce(model, batch, params=shared_params(fragments, G), chunk=4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in own.items())  # untouched
    assert shared != mean_ce(model, batch)
    for f, g in zip(fragments, G):
        f.assign(g)
    assert shared == mean_ce(model, batch, chunk=4)  # bit for bit, tied embedding included
    with pytest.raises(ValueError, match="fragment 0"):
        shared_params(fragments, [G[0][:-1], G[1]])


def test_shared_eval_runs_every_n_applied_rounds_and_once_after_a_jump():
    model, fragments = _tiny()
    inner = SimpleNamespace(evaluate=lambda batch, params: float(len(params)))
    told = []
    ev = SharedEval(inner, fragments, torch.zeros(2, 17, dtype=torch.long), every=10, report=told.append)
    states = [SimpleNamespace(last_applied=0, G=f.flat()) for f in fragments]
    done = []
    for r in [*range(1, 23), 35]:  # 35: a catch-up from 22 (a download counts: the state is the swarm's)
        states[0].last_applied = r
        if ev.maybe(states, lambda p: f"d{p}") is not None:
            done.append(r)
    assert done == [10, 20, 35] and [e.rounds[0] for e in told] == done
    assert told[0].digests == ["d0", "d1"] and told[0].sequences == 2 and told[0].tokens == 32
    assert math.isclose(told[0].perplexity, math.exp(told[0].loss))
    never = SharedEval(inner, fragments, None, every=10, report=told.append)  # no held-out data
    assert not never.due(50) and not SharedEval(inner, fragments, torch.zeros(1, 2), every=0, report=print).due(50)
