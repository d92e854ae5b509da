"""Partition of a model into fragments, and the steps schedule."""

import pytest
import torch
from torch import nn

from peer.outer.fragments import block_assignment, partition, unique_named_parameters
from peer.local.model import build_model
from peer.outer.schedule import due_round, fragment_offset, next_sync_step


def test_block_layouts():
    assert block_assignment(6, 3, "strided") == [0, 1, 0, 1, 0, 1]
    assert block_assignment(6, 3, "sequential") == [0, 0, 0, 1, 1, 1]
    assert block_assignment(7, 3, "strided") == [0, 1, 2, 0, 1, 2, 0]  # P = ceil(7/3) = 3
    assert block_assignment(7, 3, "sequential") == [0, 0, 0, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="pattern"):
        block_assignment(6, 3, "random")


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 6, 10])
def test_every_parameter_in_exactly_one_fragment(pattern, k):
    torch.manual_seed(0)
    model, blocks = build_model("tiny", 256, 32)
    frags = partition(model, blocks, k, pattern)
    L = len(blocks)
    assert len(frags) == (1 if k in (0,) or k >= L else -(-L // k))
    all_ids = [id(p) for f in frags for p in f.params]
    assert len(all_ids) == len(set(all_ids))  # disjoint
    assert set(all_ids) == {id(p) for _, p in unique_named_parameters(model)}  # covering
    assert sum(f.numel for f in frags) == sum(p.numel() for _, p in unique_named_parameters(model))
    # the tied embedding/head is counted once and sits with block 0's fragment
    emb = [f.index for f in frags for n in f.names if "emb" in n]
    assert emb == [0]


def test_strided_fragment_holds_the_expected_blocks():
    model, blocks = build_model("tiny", 256, 32)
    frags = partition(model, blocks, 3, "strided")
    for p, frag in enumerate(frags):
        ids = {id(x) for x in frag.params}
        for b, block in enumerate(blocks):
            inside = all(id(x) in ids for x in block.parameters())
            assert inside == (b % len(frags) == p)


class HeadAfterBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.head = nn.Linear(4, 10)


def test_parameters_after_the_blocks_go_with_the_last_blocks_fragment():
    m = HeadAfterBlocks()
    frags = partition(m, list(m.blocks), 2, "sequential")  # blocks 0,1 -> f0; 2,3 -> f1
    assert any(n.startswith("emb") for n in frags[0].names)
    assert any(n.startswith("head") for n in frags[1].names)
    frags = partition(m, list(m.blocks), 2, "strided")  # P = 2: last block (3) -> f1
    assert any(n.startswith("head") for n in frags[1].names)


def test_flat_and_assign_round_trip():
    model, blocks = build_model("tiny", 256, 32)
    frag = partition(model, blocks, 3)[1]
    flat = frag.flat()
    frag.assign(flat * 2)
    torch.testing.assert_close(frag.flat(), flat * 2)
    with pytest.raises(ValueError):
        frag.assign(flat[:-1])


@pytest.mark.parametrize("H, P", [(30, 3), (100, 2), (25, 4), (10, 1)])
def test_schedule_offsets_and_cadence(H, P):
    assert [fragment_offset(p, P, H) for p in range(P)] == [round(p * H / P) for p in range(P)]
    syncs = {p: [t for t in range(1, 10 * H + 1) if due_round(t, p, P, H) is not None] for p in range(P)}
    for p, ts in syncs.items():
        assert all(b - a == H for a, b in zip(ts, ts[1:]))  # each fragment every H steps
        assert [due_round(t, p, P, H) for t in ts] == list(range(1, len(ts) + 1))  # rounds 1, 2, ...
    everything = sorted(t for ts in syncs.values() for t in ts)
    gaps = {b - a for a, b in zip(everything, everything[1:])}
    assert max(gaps) <= -(-H // P)  # some fragment syncs every ~H/P steps


def test_next_sync_step():
    # P = 2, H = 20: fragment 0 syncs at 20, 40, ...; fragment 1 (offset 10) at 30, 50, ...
    assert [next_sync_step(t, 2, 20) for t in (0, 19, 20, 29, 30, 40)] == [20, 20, 30, 30, 40, 50]
