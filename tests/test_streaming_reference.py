"""The StreamingEngine on M in-process replicas (fp32 codec) equals plain transcriptions of the papers.

docs/algorithm.md section 7: "M in-process replicas (no network), fp32 codec: equals a plain transcription of Alg. 1
(P=1), Alg. 2 (P>1, tau, alpha) and eager Alg. 3 (tau = H) on the same data." The transcriptions live in
``tests/reference_algorithms.py`` and import nothing from ``peer/``. Both runs use the same toy problem (same
initial weights, per-replica data streams and inner optimizers) and equal token counts, so token weighting is 1/M.
"""

from __future__ import annotations

import pytest
import torch

from peer.outer.fragments import partition
from peer.outer.simulator import FakeTransport, Replica, run_lockstep
from peer.outer.engine import StreamingEngine
from peer.outer.settings import OuterSettings
from reference_algorithms import (Params, ToyReplica, diloco, eager_one_outer_step, fragment_offsets,
                                  make_replicas, streaming_diloco, strided_fragments)

RTOL, ATOL = 1e-5, 1e-6
LR, MOMENTUM = 0.7, 0.9
NUM_BLOCKS = 6


class EngineRun:
    """M ToyReplicas, each with a StreamingEngine over one FakeTransport(M, "fp32"), stepped by run_lockstep."""

    def __init__(self, M: int, *, H: int, blocks_per_fragment: int, tau: int, alpha: float, eager: bool,
                 inner: str = "sgd"):
        self.M = M
        self.toys = make_replicas(M, num_blocks=NUM_BLOCKS, inner=inner)
        transport = FakeTransport(M, "fp32")
        settings = OuterSettings(H=H, lr=LR, momentum=MOMENTUM, alpha=alpha, tau=tau, eager=eager, merge="alpha",
                                 wait_timeout=5.0)
        self.history: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in range(M)]
        self.engines: list[StreamingEngine] = []
        for m, toy in enumerate(self.toys):
            frags = partition(toy.model, toy.model.blocks, blocks_per_fragment, "strided")
            self.engines.append(StreamingEngine(
                frags, settings, transport.endpoint(m), group_size_hint=lambda: M,
                on_outcome=lambda frag, st, outcome, step, m=m: self.history[m].append((step, frag.index,
                                                                                        st.G.clone()))))
        self.sim = [Replica(inner_step=toy.inner_step, engine=eng) for toy, eng in zip(self.toys, self.engines)]

    @property
    def fragment_names(self) -> list[list[str]]:
        return [f.names for f in self.engines[0].fragments]

    def run(self, T: int) -> None:
        """run_lockstep one step at a time, checking after every step that the swarm state is bit-identical."""
        for t in range(T):
            run_lockstep(self.sim, 1, start=t)
            assert_shared_state_identical(self.engines, step=t + 1)


def assert_shared_state_identical(engines: list[StreamingEngine], step: int) -> None:
    for m, eng in enumerate(engines[1:], start=1):
        for p, (st, st0) in enumerate(zip(eng.states, engines[0].states)):
            assert torch.equal(st.G, st0.G), f"step {step}: replica {m}'s G_{p} differs from replica 0's"
            assert torch.equal(st.v, st0.v), f"step {step}: replica {m}'s v_{p} differs from replica 0's"
            assert st.round == st0.round, f"step {step}: replica {m}'s r_{p} differs from replica 0's"


def flat(values: Params, names: list[str]) -> torch.Tensor:
    return torch.cat([values[n].reshape(-1) for n in names])


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: engine != reference\n{m}")


def compare_replicas(run: EngineRun, expected: list[Params], what: str) -> None:
    for m, (toy, ref) in enumerate(zip(run.toys, expected)):
        got = toy.params()
        assert got.keys() == ref.keys()
        for n in ref:
            close(got[n], ref[n], f"{what}: replica {m} parameter {n}")


def compare_history(run: EngineRun, expected: list[tuple[int, int, Params]], names: list[list[str]],
                    what: str) -> None:
    """The engine's G after every applied round (on_outcome) equals the reference's outer params then."""
    got = run.history[0]
    assert [(s, p) for s, p, _ in got] == [(s, p) for s, p, _ in expected], f"{what}: rounds applied at other steps"
    for (s, p, G), (_, _, ref) in zip(got, expected):
        close(G, flat(ref, names[p]), f"{what}: G_{p} after the round applied at step {s}")


def compare_outer_state(run: EngineRun, ref, what: str) -> None:
    """tau = H: S = G + E is replica m's outer parameters theta_m^(t-H) of Alg. 3; G is theta_0 stepped with the
    received averages only (the shared machine of docs/algorithm.md section 5)."""
    for m, eng in enumerate(run.engines):
        for p, (st, names) in enumerate(zip(eng.states, run.fragment_names)):
            close(st.sync_point(), flat(ref.outer[m], names), f"{what}: replica {m}'s S_{p} vs theta_m^(t-H)")
            close(st.G + st.E, flat(ref.outer[m], names), f"{what}: replica {m}'s G_{p} + E_{p} vs theta_m^(t-H)")
            close(st.G, flat(ref.shared, names), f"{what}: replica {m}'s G_{p} vs theta_0 + received averages")


# ------------------------------------------------------------------------------------------ sanity of the setup
def test_reference_fragments_match_partition():
    toy = ToyReplica(0, num_blocks=NUM_BLOCKS)
    for k, P in [(6, 1), (3, 2), (2, 3)]:
        frags = partition(toy.model, toy.model.blocks, k, "strided")
        assert [f.names for f in frags] == strided_fragments(NUM_BLOCKS, P)
    assert fragment_offsets(3, 8) == [0, 3, 5] and fragment_offsets(2, 6) == [0, 3]


def test_streaming_reference_reduces_to_diloco_reference():
    """Streaming Alg. 2 with P = 1, tau = 0, alpha = 0 is Alg. 1 (the two transcriptions agree)."""
    a = diloco(make_replicas(3), H=4, T=14)
    b = streaming_diloco(make_replicas(3), H=4, T=14, fragments=strided_fragments(NUM_BLOCKS, 1), tau=0, alpha=0.0)
    for ra, rb in zip(a.replicas, b.replicas):
        for n in ra:
            torch.testing.assert_close(ra[n], rb[n], rtol=0, atol=0)


def test_references_are_not_trivial():
    """The cases below distinguish what they test: outer steps move the weights; eager != naive; alpha, tau matter."""
    names = strided_fragments(NUM_BLOCKS, 1)[0]
    local = make_replicas(2)
    for _ in range(12):
        for r in local:
            r.inner_step()
    synced = diloco(make_replicas(2), H=4, T=12)
    assert (flat(synced.replicas[0], names) - flat(local[0].params(), names)).abs().max() > 1e-2
    eager = eager_one_outer_step(make_replicas(3), H=4, T=16, eager=True)
    naive = eager_one_outer_step(make_replicas(3), H=4, T=16, eager=False)
    assert (flat(eager.replicas[0], names) - flat(naive.replicas[0], names)).abs().max() > 1e-3
    frags = strided_fragments(NUM_BLOCKS, 2)
    results = [streaming_diloco(make_replicas(2), H=6, T=20, fragments=frags, tau=tau, alpha=alpha)
               for tau, alpha in [(0, 0.0), (0, 0.5), (3, 0.0)]]
    for other in results[1:]:
        assert (flat(other.replicas[0], names) - flat(results[0].replicas[0], names)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------ DiLoCo Alg. 1
@pytest.mark.parametrize("M,inner", [(1, "sgd"), (3, "sgd"), (3, "adamw")])
def test_p1_tau0_equals_diloco_alg1(M, inner):
    H, T = 5, 5 * 4 + 3  # four outer rounds (momentum carried), then three more inner steps
    run = EngineRun(M, H=H, blocks_per_fragment=0, tau=0, alpha=0.0, eager=False, inner=inner)
    assert len(run.engines[0].fragments) == 1
    run.run(T)
    ref = diloco(make_replicas(M, num_blocks=NUM_BLOCKS, inner=inner), H=H, T=T, lr=LR, momentum=MOMENTUM)
    what = f"DiLoCo M={M} {inner}"
    compare_replicas(run, ref.replicas, what)
    names = run.fragment_names
    for m, eng in enumerate(run.engines):
        close(eng.states[0].G, flat(ref.outer[m], names[0]), f"{what}: replica {m}'s G vs theta_m^(t-H)")
    compare_history(run, ref.history, names, what)
    assert [s for s, _, _ in run.history[0]] == [5, 10, 15, 20]


# ------------------------------------------------------------------------------------------ Streaming Alg. 2
@pytest.mark.parametrize("blocks_per_fragment,P,H", [(3, 2, 6), (2, 3, 8)])
@pytest.mark.parametrize("tau", [0, 1, 3])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_streaming_equals_alg2(blocks_per_fragment, P, H, tau, alpha):
    M, T = 3, 4 * H + 5  # about four rounds per fragment; the last one of some fragment still in flight
    run = EngineRun(M, H=H, blocks_per_fragment=blocks_per_fragment, tau=tau, alpha=alpha, eager=False)
    names = run.fragment_names
    assert len(names) == P and names == strided_fragments(NUM_BLOCKS, P)
    run.run(T)
    ref = streaming_diloco(make_replicas(M, num_blocks=NUM_BLOCKS), H=H, T=T, fragments=names, tau=tau,
                           alpha=alpha, lr=LR, momentum=MOMENTUM)
    what = f"Streaming P={P} H={H} tau={tau} alpha={alpha}"
    compare_replicas(run, ref.replicas, what)
    for p in range(P):
        close(run.engines[0].states[p].G, flat(ref.outer[p], names[p]), f"{what}: G_{p}")
    compare_history(run, ref.history, names, what)
    # schedule: fragment p's round launched at t_p + r*H is applied tau steps later
    offsets = fragment_offsets(P, H)
    expected_steps = sorted((t_p + r * H + tau, p) for p, t_p in enumerate(offsets)
                            for r in range(1, T) if t_p + r * H + tau <= T)
    assert sorted((s, p) for s, p, _ in run.history[0]) == expected_steps


# ------------------------------------------------------------------------------------------ eager Alg. 3 / naive Alg. 2
@pytest.mark.parametrize("eager", [True, False], ids=["eager-alg3", "naive-alg2"])
@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_tau_H_equals_eager_paper(eager, inner):
    M, H = 3, 5
    T = 5 * H + 2  # syncs at 5..25: nothing applied at 5, four outer steps, then two inner steps
    run = EngineRun(M, H=H, blocks_per_fragment=0, tau=H, alpha=0.0, eager=eager, inner=inner)
    run.run(T)
    ref = eager_one_outer_step(make_replicas(M, num_blocks=NUM_BLOCKS, inner=inner), H=H, T=T, eager=eager,
                               lr=LR, momentum=MOMENTUM)
    what = f"tau=H {'eager Alg. 3' if eager else 'naive Alg. 2'} {inner}"
    compare_replicas(run, ref.replicas, what)
    names = run.fragment_names
    compare_outer_state(run, ref, what)
    compare_history(run, ref.history, names, what)
    assert [s for s, _, _ in run.history[0]] == [10, 15, 20, 25]
    # the replicas are never synchronized in these algorithms: they really differ
    assert (run.toys[0].params()["head.weight"] - run.toys[1].params()["head.weight"]).abs().max() > 1e-4


@pytest.mark.parametrize("eager", [True, False], ids=["eager-alg3", "naive-alg2"])
def test_tau_H_streaming_equals_eager_paper_per_fragment(eager):
    """P = 3 (offsets 0, 3, 5 for H = 8), tau = H: Alg. 3 / Alg. 2 run per fragment on the streaming schedule
    (docs/algorithm.md section 5, "at each sync event of p"), eager scale 1/M for equal peers."""
    M, H, P = 3, 8, 3
    T = 4 * H + 6
    run = EngineRun(M, H=H, blocks_per_fragment=2, tau=H, alpha=0.0, eager=eager)
    names = run.fragment_names
    assert len(names) == P
    run.run(T)
    ref = eager_one_outer_step(make_replicas(M, num_blocks=NUM_BLOCKS), H=H, T=T, eager=eager, lr=LR,
                               momentum=MOMENTUM, fragments=names)
    what = f"tau=H P={P} {'eager Alg. 3' if eager else 'naive Alg. 2'}"
    compare_outer_state(run, ref, what)
    compare_replicas(run, ref.replicas, what)
    compare_history(run, ref.history, names, what)


def test_eager_launch_jump_uses_share_one_over_M_for_equal_peers():
    """0 < tau < H, eager (docs/algorithm.md section 5): at launch E_p = Nesterov_step(G_p, v_p, (w_m/W) Delta_m) - G_p
    with w_m/W "1/M for equal peers". Every replica here processes the same tokens every step, so every launch of
    every fragment must use 1/M -- including fragments p > 0, whose first round spans t_p + H steps."""
    M, H, tau = 3, 8, 1
    run = EngineRun(M, H=H, blocks_per_fragment=2, tau=tau, alpha=0.0, eager=True)
    offsets = fragment_offsets(len(run.fragment_names), H)
    bad = []
    for t in range(1, 4 * H + 1):
        run_lockstep(run.sim, 1, start=t - 1)
        for p, t_p in enumerate(offsets):
            if t - t_p <= 0 or (t - t_p) % H:
                continue
            for m, eng in enumerate(run.engines):
                st, pend = eng.states[p], eng.pending[p][-1]
                assert pend.launch_step == t
                d = pend.delta / M
                expected = -LR * (d + MOMENTUM * (MOMENTUM * st.v + d))
                # alpha = 0: the jump is from theta = G - Delta to G + E, so E = jump - Delta
                E = pend.jump - pend.delta
                if not torch.allclose(E, expected, rtol=RTOL, atol=ATOL):
                    # the share the engine used instead: E is linear in it where v = 0 ... solve elementwise
                    s = (E + LR * MOMENTUM ** 2 * st.v) / (-LR * (1 + MOMENTUM) * pend.delta)
                    bad.append(f"step {t} fragment {p} round {pend.round} replica {m}: share {s.median():.4f} "
                               f"!= 1/M = {1 / M:.4f}")
    assert not bad, "eager jump not scaled by 1/M for equal peers:\n" + "\n".join(bad)
