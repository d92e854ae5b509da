"""The outer step's CPU path: fused numba kernels (``peer/outer/cpu_kernels.py``) for the Nesterov step and the
eager jump, one pass over memory where the torch path makes one per term and keeps temporaries.

Contract: each function gives exactly the bits of the torch path it stands for
(:meth:`peer.outer.state.NesterovSGD.step_into`; the effect, ``+ G``, scatter and ``- theta`` of
:meth:`peer.outer.eager.Eager.jump`) and returns False, having changed nothing, where it does not apply (no numba, or a tensor
not float32, contiguous and on the CPU): the caller then runs that torch path. Threads as in
:mod:`peer.outer.cpu_path`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from peer.outer.cpu_path import kernels, parallel


def _arrays(*tensors: torch.Tensor) -> Optional[list[np.ndarray]]:
    """The tensors' float32 host memory as 1-D numpy arrays (shared), or None where one is not such a tensor."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return None
    return [t.detach().reshape(-1).numpy() for t in tensors]


def _run(kernel, arrays: Sequence[np.ndarray], scalars: tuple, n: int) -> None:
    if parallel(lambda i0, i1: kernel(*arrays, *scalars, i0, i1), n, 1) & 2:
        raise RuntimeError(f"{kernel.__name__}: arrays shorter than the range")  # (the sizes above rule it out)


def nesterov_into(G: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, G_out: torch.Tensor, v_out: torch.Tensor,
                  momentum: float, lr: float) -> bool:
    """``v_out = v * momentum + delta``, ``G_out = G - (v_out * momentum + delta) * lr``, one pass."""
    K = kernels()
    n = G.numel()
    arrays = _arrays(G, v, delta, G_out, v_out) if K is not None else None
    if K is None or arrays is None or any(t.numel() != n for t in (v, delta, G_out, v_out)):
        return False
    _run(K.nesterov, arrays, (np.float32(momentum), np.float32(lr)), n)
    return True


def eager_jump(params: Sequence[torch.Tensor], G: torch.Tensor, v: torch.Tensor, delta: torch.Tensor,
               jump: torch.Tensor, k_v: float, k_out: float) -> bool:
    """Over the flat vector of ``params`` (their concatenation: ``theta``), one pass: ``t = (v * k_v + delta) *
    k_out + G``, ``jump = t - theta``, ``theta = t`` (written into the parameters)."""
    K = kernels()
    n = G.numel()
    if K is None or _arrays(G, v, delta, jump, *params) is None or sum(p.numel() for p in params) != n \
            or any(t.numel() != n for t in (v, delta, jump)):
        return False
    scalars, offset = (np.float32(k_v), np.float32(k_out)), 0
    for p in params:
        k = p.numel()
        sl = slice(offset, offset + k)
        arrays = _arrays(p, G[sl], v[sl], delta[sl], jump[sl])
        assert arrays is not None
        _run(K.eager_jump, arrays, scalars, k)
        torch.autograd.graph.increment_version(p)  # (written through numpy: autograd's counter must see it)
        offset += k
    return True
