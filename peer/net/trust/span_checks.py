"""What a member checks in the span results of a round before applying them (pure torch; the RPC runner is
``peer/net/round/allreduce.py``). A member does not see the other members' parts, so it checks what it can see:

1. **Size** (:func:`implausible`): a result whose RMS is over ``PLAUSIBLE`` times both our own outer gradient's
   and the round's median span result's (a reducer that scales its average).
2. **Direction** (:func:`disagreeing`): our own part of every span went into that span's aggregate, so an honest
   result leans our way (a cosine of about ``1/sqrt(n)`` even when the parts share nothing), and every honest span
   of a round gives about the same cosine. A span far below the round's reference (the span we reduce ourselves,
   else the lower median), by the relative bound ``AGREEMENT`` and beyond the honest spread ``SPREAD /
   sqrt(elements)``, was not made from our part: a reducer that flips, replaces or zeroes its average. Below
   ``MIN_REFERENCE`` or ``MIN_ELEMENTS`` there is too little to judge.

A span that fails is missing (not applied) and its reducer is reported (an offence). A reducer that sends different
averages to different members is caught by the digest check; one that shades its result inside both bounds is not.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

# A member refuses a span result whose RMS exceeds PLAUSIBLE x both references of implausible(). A false alarm
# needs an honest span 10x the RMS of our whole outer gradient and of the median span of the round.
PLAUSIBLE = 10.0
# ... and one whose cosine with our part is below AGREEMENT x the round's reference and more than SPREAD / sqrt(
# elements) below it (disagreeing()). An honest span's cosine strays from the reference by about 1 / sqrt(
# elements) (others' noise projected on our part); over 6,646 honest (member, span) pairs of 4k-16k elements,
# pure noise to a shared direction, speeds 1-4x, the farthest was 4.3 of those below (tests/test_span_checks.py).
AGREEMENT = 0.25
SPREAD = 8.0
MIN_REFERENCE = 0.05  # a reference cosine below this says too little (a tiny share of ours): no judgement
# Spans shorter than this are not judged: the spread of an honest cosine is ~sqrt(n / elements), and a model's
# spans are far longer (the tiny preset's: ~100k elements); at 256 elements pure noise spread 0.23 down to 0.04.
MIN_ELEMENTS = 4096


def _rms(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t)) / math.sqrt(max(1, t.numel()))


def implausible(result: torch.Tensor, ours: torch.Tensor, round_results: Sequence[torch.Tensor]) -> Optional[str]:
    """Why a span's ``result`` cannot be an honest combination of the group's parts, or None: its RMS exceeds
    PLAUSIBLE x the RMS of our whole outer gradient ``ours`` and PLAUSIBLE x the lower median RMS of the
    round's span results ``round_results`` (this one included: with fewer than half the reducers lying, the
    median is an honest one). Two references, so that a small gradient of ours (few steps since the last
    round) is no false alarm."""
    scales = sorted(_rms(r) for r in round_results) or [0.0]
    limit = PLAUSIBLE * max(_rms(ours), scales[(len(scales) - 1) // 2])
    if _rms(result) > limit:
        return f"implausible average: RMS {_rms(result):.3g}, more than {PLAUSIBLE:g}x ours and the round's median"
    return None


def cosine(result: torch.Tensor, ours: torch.Tensor) -> Optional[float]:
    """cos(result, ours) in fp64; 0 for a zero result; None where our part is zero (nothing to judge by)."""
    nr, no = (torch.linalg.vector_norm(t, dtype=torch.float64) for t in (result, ours))
    if float(no) == 0.0:
        return None
    return 0.0 if float(nr) == 0.0 else float(torch.dot(result.double(), ours.double()) / (nr * no))


def disagreeing(results: dict[int, torch.Tensor], ours: dict[int, torch.Tensor],
                own: Optional[int]) -> dict[int, str]:
    """The spans whose result does not lean our way, with why: ``results[j]`` the decoded result of span j,
    ``ours[j]`` the part we sent to it, ``own`` the span we reduced ourselves (the trusted reference), if
    any. The reference is that span's cosine, else the lower median of all (an honest one while fewer than
    half the reducers lie). Spans where our part is zero, or shorter than MIN_ELEMENTS, are not judged."""
    cos = {j: c for j in results if j in ours and results[j].numel() >= MIN_ELEMENTS
           and (c := cosine(results[j], ours[j])) is not None}
    if not cos:
        return {}
    ordered = sorted(cos.values())
    reference = cos[own] if own in cos else ordered[(len(ordered) - 1) // 2]
    if reference < MIN_REFERENCE:
        return {}
    return {j: f"average does not lean toward our part: cosine {c:.3f}, the round's others {reference:.3f}"
            for j, c in cos.items() if j != own and c < AGREEMENT * reference
            and c < reference - SPREAD / math.sqrt(results[j].numel())}
