"""The outer step's CPU path: fused numba kernels (``peer/outer/cpu_kernels.py``) for the Nesterov step and the
launch's and apply's passes over a fragment's parameters, one pass over memory and one call per fragment where the
torch path makes one op per term and per parameter (each op gives the GIL back, and on a peer whose other threads
are busy getting it back can take a scheduler's time slice).

Contract: each function gives exactly the bits of the torch path it stands for
(:meth:`peer.outer.state.NesterovSGD.step_into`; :func:`peer.outer.offload.difference` and
:func:`peer.outer.offload.scatter`; the effect, ``+ G``, scatter and ``- theta`` of
:meth:`peer.outer.eager.Eager.jump`) and returns False, having changed nothing, where it does not apply (no numba,
or a tensor not float32, contiguous and on the CPU): the caller then runs that torch path. Parameters written
through a kernel have their autograd version bumped, as an in-place torch op would. Threads as in
:mod:`peer.outer.cpu_path`; a small fragment's pass holds the GIL (:data:`HELD_BELOW`).
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import numpy as np
import torch

from peer.outer.cpu_path import kernels, param_list, parallel


def _arrays(*tensors: torch.Tensor) -> Optional[list[np.ndarray]]:
    """The tensors' float32 host memory as 1-D numpy arrays (shared), or None where one is not such a tensor."""
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return None
    return [t.detach().reshape(-1).numpy() for t in tensors]


HELD_BELOW = 1 << 21  # elements under which a kernel holds the GIL (a few ms: about what getting it back costs)


def _run(K, name: str, args: tuple, n: int) -> None:
    """Kernel ``name`` of ``K`` over elements [0, n): holding the GIL below :data:`HELD_BELOW`, else on threads."""
    if n < HELD_BELOW:
        flag = getattr(K, name + "_held")(*args, 0, n)
    else:
        kernel = getattr(K, name)
        flag = parallel(lambda i0, i1: kernel(*args, i0, i1), n, 1)
    if flag & 2:
        raise RuntimeError(f"{name}: arrays shorter than the range")  # (the sizes above rule it out)


# a fragment's parameters as the kernels take them, kept while the first parameter lives (building the list costs
# more than a small fragment's pass): id(first parameter) -> (a weak reference to it, the parameters' data pointers
# and sizes, the list, its offsets); an entry leaves with its parameter
_LISTS: dict[int, tuple] = {}


def _listed(params: Sequence[torch.Tensor]) -> Optional[tuple[object, np.ndarray]]:
    """The kernels' list and offsets for ``params`` (reused while every parameter's memory is the same), or None
    where one is not a float32 contiguous CPU tensor."""
    key = tuple((p.data_ptr(), p.numel()) for p in params)
    cached = _LISTS.get(id(params[0])) if params else None
    if cached is not None and cached[0]() is params[0] and cached[1] == key:
        return cached[2], cached[3]
    arrays = _arrays(*params)
    if arrays is None:
        return None
    listed, offsets = param_list(arrays)
    if params:
        first = id(params[0])

        def forget(_: object) -> None:
            _LISTS.pop(first, None)

        _LISTS[first] = (weakref.ref(params[0], forget), key, listed, offsets)
    return listed, offsets


def nesterov_into(G: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, G_out: torch.Tensor, v_out: torch.Tensor,
                  momentum: float, lr: float) -> bool:
    """``v_out = v * momentum + delta``, ``G_out = G - (v_out * momentum + delta) * lr``, one pass."""
    K = kernels()
    n = G.numel()
    arrays = _arrays(G, v, delta, G_out, v_out) if K is not None else None
    if K is None or arrays is None or any(t.numel() != n for t in (v, delta, G_out, v_out)):
        return False
    _run(K, "nesterov", (*arrays, np.float32(momentum), np.float32(lr)), n)
    return True


def _over_params(params: Sequence[torch.Tensor], name: str, flats: Sequence[torch.Tensor], scalars: tuple = (),
                 writes: bool = False) -> bool:
    """Runs kernel ``name`` over the parameters (as one list) and the fragment-sized vectors ``flats``."""
    K = kernels()
    n = sum(p.numel() for p in params)
    if K is None or any(t.numel() != n for t in flats):
        return False
    vectors = _arrays(*flats)
    listed = _listed(params) if vectors is not None else None
    if listed is None or vectors is None:
        return False
    _run(K, name, (*listed, *vectors, *scalars), n)
    if writes:
        for p in params:
            torch.autograd.graph.increment_version(p)  # (written through numpy: autograd's counter must see it)
    return True


def eager_jump(params: Sequence[torch.Tensor], G: torch.Tensor, v: torch.Tensor, delta: torch.Tensor,
               jump: torch.Tensor, k_v: float, k_out: float) -> bool:
    """Over the flat vector of ``params`` (their concatenation: ``theta``), one pass: ``t = (v * k_v + delta) *
    k_out + G``, ``jump = t - theta``, ``theta = t`` (written into the parameters)."""
    return _over_params(params, "eager_jump", (G, v, delta, jump), (np.float32(k_v), np.float32(k_out)), writes=True)


def difference(params: Sequence[torch.Tensor], S: torch.Tensor, out: torch.Tensor) -> bool:
    """``out = S - theta``, ``theta`` the parameters' flat vector."""
    return _over_params(params, "difference", (S, out))


def assign(params: Sequence[torch.Tensor], src: torch.Tensor) -> bool:
    """The parameters' flat vector = ``src``."""
    return _over_params(params, "assign", (src,), writes=True)
