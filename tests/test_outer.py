"""The outer step against DiLoCo Algorithm 1 computed by hand on small tensors."""

import torch

from peer.outer.rounds import Span
from peer.outer.state import FragmentState, NesterovSGD, apply_round


def diloco_by_hand(theta0, worker_thetas, weights, lr, mu, v0):
    """DiLoCo Alg. 1 lines 9-11 written out: Delta = mean_i(theta0 - theta_i); Nesterov SGD."""
    total = sum(weights)
    delta = sum(w * (theta0 - th) for w, th in zip(weights, worker_thetas)) / total
    v = mu * v0 + delta
    return theta0 - lr * (delta + mu * v), v


def test_outer_step_equals_algorithm_1_by_hand():
    torch.manual_seed(0)
    theta0 = torch.randn(10)
    opt = NesterovSGD(lr=0.7, momentum=0.9)
    st = FragmentState.from_params(theta0)
    v_ref = torch.zeros(10)
    G_ref = theta0.clone()
    for _ in range(3):  # three outer rounds, momentum carries over
        workers = [G_ref + 0.1 * torch.randn(10) for _ in range(3)]
        weights = [100.0, 300.0, 200.0]
        avg = sum(w * st.outer_gradient(th) for w, th in zip(weights, workers)) / sum(weights)
        new_theta, _ = apply_round(st, workers[0], [Span(0, 10, avg)], opt, alpha=0.0)
        G_ref, v_ref = diloco_by_hand(G_ref, workers, weights, 0.7, 0.9, v_ref)
        torch.testing.assert_close(st.G, G_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(st.v, v_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(new_theta, G_ref)  # alpha = 0: take the synced value
        torch.testing.assert_close(st.sync_point(), G_ref)  # the next phase starts from the new G


def test_outer_step_matches_torch_sgd_nesterov():
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(7))
    sgd = torch.optim.SGD([p], lr=0.4, momentum=0.9, nesterov=True)
    st = FragmentState.from_params(p.detach())
    for _ in range(4):
        g = torch.randn(7)
        p.grad = g.clone()
        sgd.step()
        apply_round(st, st.G.clone(), [Span(0, 7, g)], NesterovSGD(lr=0.4, momentum=0.9), alpha=0.0)
        torch.testing.assert_close(st.G, p.detach(), rtol=1e-6, atol=1e-6)


def test_alpha_merge_and_missing_span_keeps_progress():
    st = FragmentState.from_params(torch.zeros(8))
    theta = torch.full((8,), -1.0)  # moved by -1 everywhere: Delta = +1
    delta = st.outer_gradient(theta)
    spans = [Span(0, 4, delta[:4]), Span(4, 8, None)]  # the second reducer died
    new, applied = apply_round(st, theta, spans, NesterovSGD(lr=1.0, momentum=0.0), alpha=0.25)
    assert applied.tolist() == [True] * 4 + [False] * 4
    # applied span: G = 0 - 1*1 = -1; theta = 0.25*(-1) + 0.75*(-1) = -1; S = G
    torch.testing.assert_close(st.G[:4], torch.full((4,), -1.0))
    torch.testing.assert_close(new[:4], torch.full((4,), -1.0))
    # missing span: nothing changed, the local progress stays in S - theta for the next round
    torch.testing.assert_close(st.G[4:], torch.zeros(4))
    torch.testing.assert_close(st.v[4:], torch.zeros(4))
    torch.testing.assert_close(new[4:], theta[4:])
    torch.testing.assert_close(st.outer_gradient(new)[4:], torch.ones(4))


def test_digest_changes_with_the_shared_state_g_and_v_only():
    """The digest identifies the shared state (G, v: a joiner downloads both, and verifies both by it), not the
    per-peer eager terms."""
    st = FragmentState.from_params(torch.arange(5.0), ("E",))
    d0 = st.digest()
    st.E += 1
    assert st.digest() == d0
    st.v[1] = torch.nextafter(st.v[1], torch.tensor(10.0))  # one ulp of the momentum
    d1 = st.digest()
    assert d1 != d0
    st.G[2] = torch.nextafter(st.G[2], torch.tensor(10.0))  # one ulp of the parameters
    assert st.digest() not in (d0, d1)


def test_effect_is_the_move_of_one_outer_step_without_changing_the_state():
    """The eager jump's E: what step_ would add to G for ``scale * delta`` (up to rounding), written into ``out``."""
    torch.manual_seed(0)
    opt = NesterovSGD(lr=0.7, momentum=0.9)
    G, v, delta = torch.randn(1000), torch.randn(1000), torch.randn(1000)
    before = (G.clone(), v.clone())
    out = torch.empty(1000)
    E = opt.effect(v, delta, scale=0.25, out=out)
    assert E.data_ptr() == out.data_ptr() and torch.equal(G, before[0]) and torch.equal(v, before[1])
    stepped_G, stepped_v = G.clone(), v.clone()
    opt.step_(stepped_G, stepped_v, 0.25 * delta)
    torch.testing.assert_close(E, stepped_G - G, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.effect(v, delta), opt.effect(v, delta, scale=1.0, out=torch.empty(1000)), rtol=0,
                               atol=0)


def test_block_digests_are_the_same_hashed_in_parallel(monkeypatch):
    """A large state is hashed by several threads (BLAKE3 lets go of the GIL): the same digests, in order."""
    from peer.outer import state

    n = 3 * 64 * state.DIGEST_BLOCK + 12345  # three threads' worth and a partial last block
    G, v = torch.randn(n), torch.randn(n)
    monkeypatch.setattr(state, "HASH_THREADS", 1)
    serial = state.block_digests(G, v)
    monkeypatch.setattr(state, "HASH_THREADS", 3)
    assert state.block_digests(G, v) == serial and len(serial) == -(-n // state.DIGEST_BLOCK)
    G[-1] += 1.0  # (the last block is hashed too)
    assert state.block_digests(G, v)[-1] != serial[-1]
