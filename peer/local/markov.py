"""The synthetic corpus (:class:`MarkovSource`, the default data source) and what every source shares: the seed
derivation (:func:`derive_seed`, one domain tag per random stream so that no two ever share one) and the checks of a
batch's shape and of a saved cursor.

Deterministic given ``(seed, shard_index)``; the cursor is the count of batches served (``state_dict``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

# Domain-separation tags so the chain, the sample streams and file offsets never
# share random streams even for equal (seed, shard) numbers.
TAG_CHAIN, TAG_SAMPLES, TAG_OFFSET, TAG_HELD_OUT = 0x4348, 0x534D, 0x4F46, 0x484F


def derive_seed(*words: int) -> int:
    """A 63-bit seed mixed from non-negative ints (numpy SeedSequence hashing)."""
    state = np.random.SeedSequence([int(w) for w in words]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def check_cursor(state: dict, mine: dict, keys: tuple[str, ...], hints: Optional[dict[str, str]] = None) -> None:
    """Raises ValueError naming the first of ``keys`` on which a saved cursor ``state`` and this source's own
    (``mine``) differ: a cursor of another stream (``hints``: what to add to the message, by key)."""
    for key in keys:
        if state.get(key) != mine[key]:
            hint = (hints or {}).get(key, "")
            raise ValueError(f"data cursor is for {key}={state.get(key)!r}, this source has {mine[key]!r}{hint}")


def check_shape(batch_size: int, seq_len: int) -> None:
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")


class MarkovSource:
    """Synthetic corpus: a first-order Markov chain with known entropy rate.

    Chain (depends on ``(vocab_size, seed)`` only, so every shard samples the same
    "language"): row ``i`` has ``support`` successors, chosen without replacement and
    always including ``(i + 1) % V`` (the cycle makes the chain irreducible; row 0
    also contains 0, a self-loop that makes it aperiodic), weighted by a
    Dirichlet(``alpha``) draw. With the defaults (support 16, alpha 0.5) the entropy
    rate is about 2 nats for any vocab, far below log(V) yet learnable by a tiny model.

    Samples: batch ``n`` of shard ``s`` is drawn from a torch generator seeded by
    ``(seed, s, n)``; each row starts from the stationary distribution π, so the
    optimal predictor's expected CE is exactly ``entropy_rate`` at every target
    position. The cursor is the batch counter ``n``.
    """

    def __init__(
        self, vocab_size: int, seed: int, shard_index: int = 0, *, support: int = 16, alpha: float = 0.5
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"synthetic source needs vocab_size >= 2, got {vocab_size}")
        if seed < 0 or shard_index < 0:
            raise ValueError(f"seed and shard_index must be >= 0, got {seed}, {shard_index}")
        self.vocab_size = vocab_size
        self.seed = seed
        self.shard_index = shard_index
        self.support = k = min(support, vocab_size)
        self.alpha = alpha
        self._batches_served = 0

        rng = np.random.default_rng(derive_seed(TAG_CHAIN, seed, vocab_size, k))
        succ = np.empty((vocab_size, k), dtype=np.int64)
        for i in range(vocab_size):
            nxt = (i + 1) % vocab_size
            # Draw k-1 others from the V-1 tokens != nxt, then map past nxt.
            others = rng.choice(vocab_size - 1, size=k - 1, replace=False)
            others = others + (others >= nxt)
            succ[i] = np.concatenate(([nxt], others))
        if 0 not in succ[0]:
            succ[0, -1] = 0
        probs = rng.gamma(alpha, size=(vocab_size, k))
        probs = np.maximum(probs, 1e-12)  # keep every support edge (and the cycle) alive
        probs /= probs.sum(axis=1, keepdims=True)
        self._succ_np, self._probs_np = succ, probs
        self._pi = self._stationary(succ, probs)
        row_entropy = -(probs * np.log(probs)).sum(axis=1)
        self._entropy_rate = float(self._pi @ row_entropy)

        # Sampling tables: cumulative row probabilities for searchsorted, in float64.
        self._succ = torch.from_numpy(succ)
        self._cum = torch.from_numpy(np.cumsum(probs, axis=1))
        self._cum_pi = torch.from_numpy(np.cumsum(self._pi))

    @staticmethod
    def _stationary(succ: np.ndarray, probs: np.ndarray) -> np.ndarray:
        """π with π P = π by power iteration on the lazy chain (I + P) / 2.

        The lazy chain has the same π and converges even for periodic chains.
        """
        v = succ.shape[0]
        pi = np.full(v, 1.0 / v)
        flat_succ = succ.ravel()
        for _ in range(100_000):
            step = np.bincount(flat_succ, weights=(pi[:, None] * probs).ravel(), minlength=v)
            new = 0.5 * (pi + step)
            new /= new.sum()
            if np.abs(new - pi).sum() < 1e-14:
                return new
            pi = new
        raise RuntimeError("Markov stationary distribution did not converge")

    @property
    def entropy_rate(self) -> float:
        """Entropy rate sum_i π_i H(P_i) in nats per token (the CE floor)."""
        return self._entropy_rate

    @property
    def entropy_floor(self) -> float:
        return self._entropy_rate

    @property
    def stationary(self) -> np.ndarray:
        """Stationary distribution π (float64, sums to 1)."""
        return self._pi.copy()

    def log_prob(self, batch: Tensor) -> Tensor:
        """log P(batch[:, t+1] | batch[:, t]) as float64 ``[B, T]`` (-inf off-support)."""
        prev, nxt = batch[:, :-1].cpu(), batch[:, 1:].cpu()
        match = self._succ[prev] == nxt.unsqueeze(-1)  # [B, T, k]; successors are distinct
        p = (torch.from_numpy(self._probs_np)[prev] * match).sum(-1)
        return p.log()

    def next_batch(self, batch_size: int, seq_len: int) -> Tensor:
        """Return int64 ``[batch_size, seq_len + 1]``: independent rows from the chain."""
        check_shape(batch_size, seq_len)
        out = self._sample(derive_seed(TAG_SAMPLES, self.seed, self.shard_index, self._batches_served),
                           batch_size, seq_len)
        self._batches_served += 1
        return out

    def held_out(self, sequences: int, seq_len: int) -> Tensor:
        """``[sequences, seq_len + 1]`` rows of the held-out stream: the same chain, a sample stream no shard
        trains on (its own tag), the same rows on every peer of the run."""
        check_shape(sequences, seq_len)
        return self._sample(derive_seed(TAG_HELD_OUT, self.seed), sequences, seq_len)

    def _sample(self, seed: int, batch_size: int, seq_len: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        # Position-major so each u[t] is a contiguous [B] slice for searchsorted.
        u = torch.rand(seq_len + 1, batch_size, generator=g, dtype=torch.float64)
        out = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
        # right=True skips zero-width intervals; clamp guards u beyond a cumsum of 1-ulp.
        cur = torch.searchsorted(self._cum_pi, u[0], right=True).clamp_(max=self.vocab_size - 1)
        out[:, 0] = cur
        last = self.support - 1
        for t in range(1, seq_len + 1):
            idx = torch.searchsorted(self._cum[cur], u[t].unsqueeze(1), right=True).clamp_(max=last)
            cur = self._succ[cur, idx.squeeze(1)]
            out[:, t] = cur
        return out

    def state_dict(self) -> dict:
        return {
            "kind": "synthetic",
            "seed": self.seed,
            "shard_index": self.shard_index,
            "vocab_size": self.vocab_size,
            "batches_served": self._batches_served,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the cursor; raises ValueError if the state is for another stream."""
        check_cursor(state, self.state_dict(), ("kind", "seed", "shard_index", "vocab_size"))
        self._batches_served = int(state["batches_served"])
