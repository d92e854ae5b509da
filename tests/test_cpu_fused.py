"""The outer step's numba CPU path (peer/outer/cpu_fused.py) against its torch path, bit for bit: the Nesterov
step into new tensors, the eager jump over a fragment's parameters, :func:`advanced` against a copy advanced in
place, and the engine with and without the kernels; and the fallback where a kernel does not apply."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("numba")
if os.environ.get("SWARMLOCO_NO_NUMBA") == "1":
    pytest.skip("SWARMLOCO_NO_NUMBA=1: no kernels to compare", allow_module_level=True)

from peer.outer import cpu_fused  # noqa: E402
from peer.outer.cpu_path import kernels  # noqa: E402
from peer.outer.engine import StreamingEngine  # noqa: E402
from peer.outer.fragments import Fragment  # noqa: E402
from peer.outer.rounds import RoundOutcome, Span  # noqa: E402
from peer.outer.settings import OuterSettings  # noqa: E402
from peer.outer.state import NesterovSGD, advance_shared, advanced  # noqa: E402
from tests.test_streaming_engine import ScriptedTransport  # noqa: E402

# sizes: empty, one, around a vector's width, over a million (still holding the GIL), and one the threads share
SIZES = [0, 1, 7, 64, 1001, (3 << 18) + 5, cpu_fused.HELD_BELOW + 5]


def values(n: int, seed: int) -> torch.Tensor:
    """Magnitudes from subnormal to 1e30, both signs, and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-40, 31, (n,), generator=g).float())
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    return x


def test_the_kernels_compile_here():
    assert kernels() is not None


@pytest.mark.parametrize("n", SIZES)
def test_nesterov_into_gives_the_in_place_step_bit_for_bit(n):
    opt = NesterovSGD(lr=0.7, momentum=0.9)
    G, v, d = values(n, 1), values(n, 2), values(n, 3)
    G_out, v_out = torch.empty(n), torch.empty(n)
    assert cpu_fused.nesterov_into(G, v, d, G_out, v_out, opt.momentum, opt.lr)
    ref_G, ref_v = G.clone(), v.clone()
    opt.step_(ref_G, ref_v, d)
    assert torch.equal(G_out.view(torch.int32), ref_G.view(torch.int32))
    assert torch.equal(v_out.view(torch.int32), ref_v.view(torch.int32))


@pytest.mark.parametrize("share", [0.5, 1 / 3, 1.0, 1e-7])
def test_eager_jump_gives_the_torch_path_bit_for_bit(share):
    """Parameters of several shapes: the weights jumped to and the jump are those of effect, + G, the scatter and
    - theta (the threaded pass: test_a_pass_holding_the_gil_and_one_on_threads_give_the_same_bits)."""
    shapes = [(3, 5), (1 << 19,), (7,), (64, 33)]
    params = [values(s[0] * (s[1] if len(s) > 1 else 1), 10 + i).reshape(s) for i, s in enumerate(shapes)]
    n = sum(p.numel() for p in params)
    G, v, d = values(n, 4), values(n, 5) * 1e-3, values(n, 6)
    opt = NesterovSGD(lr=0.7, momentum=0.9)
    theta = torch.cat([p.reshape(-1) for p in params])
    merged = opt.effect(v, d, scale=share).add_(G)
    want_jump = merged - theta
    jump = torch.empty(n)
    k_v, k_out = opt.effect_scalars(share)
    versions = [p._version for p in params]
    assert cpu_fused.eager_jump(params, G, v, d, jump, k_v, k_out)
    assert torch.equal(torch.cat([p.reshape(-1) for p in params]).view(torch.int32), merged.view(torch.int32))
    assert torch.equal(jump.view(torch.int32), want_jump.view(torch.int32))
    assert all(p._version > was for p, was in zip(params, versions))  # (autograd sees the write)


@pytest.mark.parametrize("big", [1 << 19, cpu_fused.HELD_BELOW])  # (holding the GIL; on threads)
def test_difference_and_assign_give_the_torch_path_bit_for_bit(big):
    shapes = [(3, 5), (big,), (7,), (64, 33)]
    params = [torch.nn.Parameter(values(math.prod(s), 30 + i).reshape(s)) for i, s in enumerate(shapes)]
    n = sum(p.numel() for p in params)
    S, out = values(n, 40), torch.empty(n)
    assert cpu_fused.difference(params, S, out)
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(out.view(torch.int32), (S - theta).view(torch.int32))
    src, versions = values(n, 41), [p._version for p in params]
    assert cpu_fused.assign(params, src)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params]).view(torch.int32), src.view(torch.int32))
    assert all(p._version > was for p, was in zip(params, versions))


def test_a_launch_and_an_apply_pass_over_all_parameters_in_one_call_each(monkeypatch):
    """A fragment of many parameters: the launch runs two kernels (Delta, the jump) and the apply one (the merge),
    each once for the whole fragment, not once per parameter (each call gives the GIL back)."""
    calls = []
    real = cpu_fused._run
    passes = {"difference", "eager_jump", "assign"}  # (the passes over the parameters; the Nesterov step is the
    # worker's, or the apply's where the worker has not run it yet: counted in neither)
    monkeypatch.setattr(cpu_fused, "_run",
                        lambda K, name, args, n: (name in passes and calls.append(name)) or real(K, name, args, n))
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(12)]
    settings = OuterSettings(H=4, tau=2, eager=True, lr=0.7, momentum=0.9, wait_timeout=1.0)
    echo = ScriptedTransport(lambda f, r, d: RoundOutcome(f, r, "ok", spans=[Span(0, d.numel(), d.clone())],
                                                          total_weight=20.0))
    eng = StreamingEngine([Fragment(0, [str(i) for i in range(12)], params)], settings, echo)
    launched = []
    for step in range(1, 7):
        calls.clear()
        eng.launch_due(step)
        launched.append(len(calls))
        calls.clear()
        eng.apply_due(step)
        launched.append(len(calls))
    eng.close()
    # step 4's launch (Delta, the jump) and step 6's apply (the merge); nothing else
    assert launched == [0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 1], launched


@pytest.mark.parametrize("n", [1000, cpu_fused.HELD_BELOW + 3])
def test_a_pass_holding_the_gil_and_one_on_threads_give_the_same_bits(n, monkeypatch):
    """Below HELD_BELOW a kernel runs holding the GIL, above on threads: both the torch path's bits."""
    threaded = []
    real = cpu_fused.parallel
    monkeypatch.setattr(cpu_fused, "parallel", lambda fn, n_, b: threaded.append(n_) or real(fn, n_, b))
    params = [torch.nn.Parameter(values(n - n // 3, 50)), torch.nn.Parameter(values(n // 3, 51))]
    G, v, d = values(n, 52), values(n, 53) * 1e-3, values(n, 54)
    theta = torch.cat([p.detach() for p in params])
    opt = NesterovSGD(lr=0.7, momentum=0.9)
    merged = opt.effect(v, d, scale=0.25).add_(G)
    jump = torch.empty(n)
    assert cpu_fused.eager_jump(params, G, v, d, jump, *opt.effect_scalars(0.25))
    assert threaded == ([n] if n >= cpu_fused.HELD_BELOW else [])  # (the path the size asks for ran)
    assert torch.equal(jump.view(torch.int32), (merged - theta).view(torch.int32))
    assert torch.equal(torch.cat([p.detach() for p in params]).view(torch.int32), merged.view(torch.int32))


def test_a_kernel_that_does_not_apply_changes_nothing():
    """A bf16 parameter, or a non-contiguous input: False, and nothing written (the caller runs the torch path)."""
    params = [torch.ones(4), torch.ones(4, dtype=torch.bfloat16)]
    G, v, d, jump = torch.ones(8), torch.zeros(8), torch.ones(8), torch.full((8,), 7.0)
    assert not cpu_fused.eager_jump(params, G, v, d, jump, 0.5, -1.0)
    assert torch.equal(params[0], torch.ones(4)) and torch.equal(jump, torch.full((8,), 7.0))
    strided = torch.ones(16)[::2]
    out = torch.full((8,), 7.0)
    assert not cpu_fused.nesterov_into(strided, v, d, out, out.clone(), 0.9, 0.7)
    assert torch.equal(out, torch.full((8,), 7.0))


@pytest.mark.parametrize("spans", [
    [(0, 100, True)],
    [(0, 40, True), (40, 100, False)],
    [(60, 100, True), (0, 30, True), (30, 60, False)],  # (out of order, a gap that did not arrive)
    [(10, 20, True), (50, 70, True)],  # (elements no span covers keep their values)
    [(0, 100, False)],
])
def test_advanced_gives_a_copy_advanced_in_place(spans):
    opt = NesterovSGD(lr=0.7, momentum=0.9)
    G, v = values(100, 7), values(100, 8)
    G0, v0 = G.clone(), v.clone()
    arrived = [Span(a, b, values(b - a, 20 + a) if got else None) for a, b, got in spans]
    new_G, new_v, applied = advanced(G, v, arrived, opt)
    ref_G, ref_v = G.clone(), v.clone()
    ref_applied = advance_shared(ref_G, ref_v, arrived, opt)
    assert torch.equal(new_G.view(torch.int32), ref_G.view(torch.int32))
    assert torch.equal(new_v.view(torch.int32), ref_v.view(torch.int32))
    assert torch.equal(applied, ref_applied)
    assert applied.untyped_storage().nbytes() == (1 if ref_applied.all() else 100)  # (whole: no mask allocated)
    assert torch.equal(G, G0) and torch.equal(v, v0)  # (the state itself is never written)


def test_advanced_refuses_what_advance_shared_refuses():
    with pytest.raises(ValueError, match="shape"):
        advanced(torch.zeros(10), torch.zeros(10), [Span(0, 10, torch.zeros(9))], NesterovSGD())


def train(settings: OuterSettings, steps: int = 24) -> tuple[torch.Tensor, ...]:
    """Two fragments (a matrix and a vector; a vector), every round whole and echoed, eager at tau = 2."""
    torch.manual_seed(0)
    w, b, u = (torch.nn.Parameter(torch.randn(*s)) for s in ((9, 13), (13,), (40,)))
    frags = [Fragment(0, ["w", "b"], [w, b]), Fragment(1, ["u"], [u])]
    echo = ScriptedTransport(lambda f, r, d: RoundOutcome(f, r, "ok", spans=[Span(0, d.numel(), d.clone() * 0.5)],
                                                          total_weight=20.0))
    eng = StreamingEngine(frags, settings, echo, group_size_hint=lambda: 2)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for i, p in enumerate((w, b, u)):
                p -= torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (step + i)).reshape(p.shape) * 0.01
        eng.add_tokens(10)
        eng.launch_due(step)
        eng.apply_due(step)
    eng.drain(steps)
    eng.close()
    return tuple(t.detach().clone() for t in (w, b, u)) + tuple(t for st in eng.states for t in (st.G, st.v))


@pytest.mark.parametrize("eager, alpha", [(True, 0.0), (True, 0.25), (False, 0.0)])
def test_the_engine_gives_the_same_bits_with_and_without_the_kernels(eager, alpha, monkeypatch):
    from peer.outer import eager as eager_module

    settings = OuterSettings(H=4, tau=2, eager=eager, lr=0.7, momentum=0.9, alpha=alpha, wait_timeout=1.0)
    jumps = []
    monkeypatch.setattr(eager_module, "eager_jump", lambda *a: jumps.append(cpu_fused.eager_jump(*a)) or jumps[-1])
    fused = train(settings)
    if eager and alpha == 0.0:  # (every launch's jump ran in the kernel)
        assert len(jumps) >= 10 and all(jumps)
    else:
        assert jumps == []
    monkeypatch.setattr(cpu_fused, "kernels", lambda: None)
    plain = train(settings)
    for a, b in zip(fused, plain):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_parameter_given_new_memory_is_written_there():
    """The kernels' list of a fragment's parameters is kept between calls; a parameter whose memory was replaced
    (``p.data = ...``) is found in its new memory, not written in the old one."""
    params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(4))]
    assert cpu_fused.assign(params, torch.ones(10))
    old = params[1].data
    params[1].data = torch.zeros(4)
    assert cpu_fused.assign(params, torch.full((10,), 2.0))
    assert torch.equal(params[1].detach(), torch.full((4,), 2.0)) and torch.equal(old, torch.ones(4))
