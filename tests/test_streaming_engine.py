"""Engine behaviour beyond the reference algorithms: failures, eager undo, replay, auto tau, the worker."""

import concurrent.futures
import gc
import threading
import time
import weakref

import pytest
import torch

from peer.outer.codec import get_codec
from peer.outer.fragments import Fragment
from peer.outer.rounds import RoundOutcome, Span
from peer.outer.schedule import rolling_copies
from peer.outer.engine import StreamingEngine
from peer.outer.device_state import DeferredLaunch
from peer.outer.offload import HostBuffers
from peer.outer import state as state_module
from peer.outer.state import ErrorFeedback, FragmentState, digest_of
from peer.outer.settings import AutoTau, OuterSettings, clamp_tau
from peer.util import Ema


class ScriptedTransport:
    """Returns the outcome a test scripts for each launched round (None = never arrives)."""

    def __init__(self, outcomes):
        self.outcomes, self.launched = outcomes, []

    def launch(self, *, fragment, round_, delta, weight, step, expected_round, base=None):
        self.launched.append((fragment, round_, delta.clone(), weight, step))
        outcome = self.outcomes(fragment, round_, delta)

        class H:
            def result(self, timeout=None):
                if outcome is None:
                    raise TimeoutError
                return outcome

            def done(self):
                return outcome is not None

            def cancel(self):
                return True
        return H()


class FutureTransport:
    """Each launched round's handle is a ``concurrent.futures.Future`` (as the swarm's are). The script's outcome
    is set at once where ``at_once`` (None: never), else the test sets it (``futures``, ``launched``)."""

    def __init__(self, outcomes, at_once=True):
        self.outcomes, self.at_once = outcomes, at_once
        self.futures, self.launched = [], threading.Event()

    def launch(self, *, fragment, round_, delta, weight, step, expected_round, base=None):
        future, outcome = concurrent.futures.Future(), self.outcomes(fragment, round_, delta.clone())
        if self.at_once and outcome is not None:
            future.set_result(outcome)
        self.futures.append((future, outcome))
        self.launched.set()
        return future


def one_param_engine(settings, outcomes, value=0.0, n=8):
    p = torch.nn.Parameter(torch.full((n,), value))
    frag = Fragment(0, ["w"], [p])
    transport = ScriptedTransport(outcomes)
    return p, StreamingEngine([frag], settings, transport, group_size_hint=lambda: 2), transport


def test_missed_round_keeps_progress_and_carries_tokens():
    p, eng, tr = one_param_engine(OuterSettings(H=2, wait_timeout=0.01), lambda f, r, d: None)
    for step in (1, 2):
        with torch.no_grad():
            p -= 1.0  # "training"
        eng.add_tokens(10)
        eng.launch_due(step)
        eng.apply_due(step)
    assert eng.states[0].round == 1 and eng.states[0].applied_rounds == []
    torch.testing.assert_close(eng.states[0].G, torch.zeros(8))  # nothing applied
    torch.testing.assert_close(p.detach(), torch.full((8,), -2.0))  # local progress kept
    assert eng.states[0].tokens_since_sync == 20  # the round's tokens go into the next weight
    torch.testing.assert_close(eng.states[0].outer_gradient(p.detach()), torch.full((8,), 2.0))


@pytest.mark.parametrize("status", ["partial", "minority"])
def test_a_round_that_is_not_ok_is_applied_nowhere_and_its_eager_jump_is_undone(status):
    """Only an ok round is applied (every peer that applies it then holds one state): a partial round (the second
    span's reducer died) changes neither G nor v anywhere, and its progress and tokens are carried."""
    def half(f, r, d):
        return RoundOutcome(f, r, status, spans=[Span(0, 4, d[:4].clone()), Span(4, 8, None)], total_weight=20.0)

    p, eng, _ = one_param_engine(OuterSettings(H=4, tau=2, eager=True, lr=1.0, momentum=0.0, wait_timeout=0.01), half)
    for step in range(1, 7):
        with torch.no_grad():
            p -= 0.5 if step <= 4 else 0.0
        eng.add_tokens(10)
        eng.launch_due(step)
        if step == 4:  # eager: jumped to G + E = 0 - (1/2)*Delta(=2) at launch
            torch.testing.assert_close(p.detach(), torch.full((8,), -1.0))
        eng.apply_due(step)
    st = eng.states[0]
    torch.testing.assert_close(st.G, torch.zeros(8))  # nothing applied, the jump undone: local progress -2 kept
    torch.testing.assert_close(p.detach(), torch.full((8,), -2.0))
    assert st.E is None and eng.pending[0] == []  # the jump went with its round
    torch.testing.assert_close(st.outer_gradient(p.detach()), torch.full((8,), 2.0))
    assert st.applied_rounds == [] and st.tokens_since_sync == 60  # 40 of round 1 carried, 20 since


def test_an_off_base_round_applies_nothing_and_does_not_send_its_progress_again():
    """off_base: our part went into an average the group applied to another base. Nothing is applied here (the
    trainer downloads the group's result), and neither its tokens nor its error-feedback residual are carried: they
    were delivered."""
    from peer.outer.codec import get_codec, roundtrip

    def off(f, r, d):
        return RoundOutcome(f, r, "off_base", spans=[Span(0, 8, d.clone())], total_weight=20.0)

    codec = get_codec("e3m0")
    p = torch.nn.Parameter(torch.zeros(8))
    tr = ScriptedTransport(off)
    eng = StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=2, tau=1, eager=True, lr=1.0, momentum=0.0),
                          tr, group_size_hint=lambda: 2, error_feedback_codec=codec)
    for step in range(1, 4):
        with torch.no_grad():
            p -= torch.linspace(0.13, 0.97, 8)
        eng.add_tokens(10)
        eng.launch_due(step)
        eng.apply_due(step)
    st = eng.states[0]
    sent = tr.launched[0][2]
    torch.testing.assert_close(st.G, torch.zeros(8))
    torch.testing.assert_close(p.detach(), -3 * torch.linspace(0.13, 0.97, 8))  # the eager jump undone
    torch.testing.assert_close(eng.feedback.terms[0].residual, sent - roundtrip(sent, codec))
    assert st.applied_rounds == [] and st.tokens_since_sync == 10  # round 1's 20 tokens were delivered
    eng.close()


def test_each_launch_declares_the_base_its_average_is_applied_to():
    """Streaming: the state at launch. tau = H: the state once the previous round is applied (right after the
    launch, at the same sync event), so the base of round r is the digest after round r - 1."""
    from peer.outer.state import digest_of

    bases = []

    class Recording(ScriptedTransport):
        def launch(self, *, base, **kw):
            bases.append(base)
            return super().launch(**kw)

    full = lambda f, r, d: RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=20.0)  # noqa: E731
    for settings in (OuterSettings(H=2, tau=1, lr=1.0, momentum=0.5), OuterSettings(H=2, tau=2, lr=1.0, momentum=0.5)):
        bases.clear()
        p = torch.nn.Parameter(torch.zeros(8))
        eng = StreamingEngine([Fragment(0, ["w"], [p])], settings, Recording(full), group_size_hint=lambda: 2)
        after = {}
        for step in range(1, 8):
            with torch.no_grad():
                p -= 0.25
            eng.launch_due(step)
            if bases and settings.tau == 1:
                assert bases[-1].done()  # (streaming: known at launch)
            eng.apply_due(step)
            st = eng.states[0]
            after[st.last_applied] = digest_of(st.G, st.v)
        assert len(bases) == 3 and all(b.done() for b in bases)
        assert [b.result() for b in bases] == [(r, after[r]) for r in range(3)]
        eng.close()


def test_replay_merge_keeps_the_local_steps_made_during_overlap():
    def full(f, r, d):
        return RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=20.0)

    p, eng, _ = one_param_engine(OuterSettings(H=4, tau=2, merge="replay", lr=1.0, momentum=0.0), full)
    for step in range(1, 7):
        with torch.no_grad():
            p -= 1.0
        eng.add_tokens(10)
        eng.launch_due(step)
        eng.apply_due(step)
    # launch at 4 with Delta = 4; G = -4 applied at 6; theta = G + (theta_6 - theta_4) = -4 - 2
    torch.testing.assert_close(p.detach(), torch.full((8,), -6.0))
    torch.testing.assert_close(eng.states[0].outer_gradient(p.detach()), torch.full((8,), 2.0))


def test_auto_tau_hides_the_measured_round_time_within_bounds():
    """From the trainer's step time (which it alone updates) and the slowest of the last 8 rounds: at least 1, at
    most tau_max, and always below H (clamp_tau, the one bound the engine relies on)."""
    steps = Ema(0.3)
    auto = AutoTau(tau_max=8, H=20, step_time=steps)
    assert auto() == 8  # nothing measured yet: overlap as much as allowed
    steps.observe(0.1)
    auto.observe_round(0.35)
    assert auto() == 5  # ceil(0.35 / 0.1) + 1
    auto.observe_round(100.0)
    assert auto() == 8
    for _ in range(7):  # the slowest of the last 8 rounds: the slow one still counts...
        auto.observe_round(0.35)
    assert auto() == 8
    auto.observe_round(0.35)  # ... until 8 rounds came after it
    assert auto() == 5
    auto.observe_round(0.55)
    assert auto() == 7  # a slower round raises it at once
    fast = AutoTau(tau_max=8, H=20, step_time=Ema())
    fast.step_time.observe(1.0)
    fast.observe_round(0.01)
    assert fast() == 2
    assert AutoTau(tau_max=8, H=4, step_time=Ema())() == 3  # below H, whatever tau_max says
    assert [clamp_tau(t, 4) for t in (-1, 0, 3, 4, 9)] == [0, 0, 3, 3, 3]
    assert [clamp_tau(t, 20, tau_max=8) for t in (-1, 0, 1, 8, 9)] == [1, 1, 1, 8, 8]  # auto's bounds: 1 to tau_max
    assert [clamp_tau(t, H, tau_max=8) for t, H in ((9, 4), (0, 4), (5, 1))] == [3, 1, 0]  # ... within 0 to H - 1


def test_outer_state_holds_the_eager_terms_only_when_they_are_used():
    """Host memory and checkpoints: with tau < H, eager or not, the state allocates and saves G and v only (two
    fp32 model copies; S is derived: G, or G + E with tau = H; an eager jump is kept with its round in flight).
    tau = H keeps E (the divergence from G), and with eager updates also u (the eager machine's momentum)."""
    never = lambda f, r, d: None  # noqa: E731
    cases = {(0, False): {"G", "v"}, (1, True): {"G", "v"}, (2, False): {"G", "v", "E"},
             (2, True): {"G", "v", "E", "u"}}
    for (tau, eager), terms in cases.items():
        _, eng, _ = one_param_engine(OuterSettings(H=2, tau=tau, eager=eager), never)
        saved = eng.state_dict()["fragments"][0]
        assert {k for k, v in saved.items() if isinstance(v, torch.Tensor)} == terms, (tau, eager)
        st = eng.states[0]
        allocated = {k for k in ("G", "v", "E", "u") if getattr(st, k) is not None}
        assert allocated == terms, (tau, eager)
    # A checkpoint without them loads with zeros, also into a peer that now turns eager on.
    _, plain, _ = one_param_engine(OuterSettings(H=2), never, value=3.0)
    _, eager, _ = one_param_engine(OuterSettings(H=2, tau=2, eager=True), never)
    eager.states[0].E += 5.0
    eager.load_state_dict(plain.state_dict())
    torch.testing.assert_close(eager.states[0].G, torch.full((8,), 3.0))
    assert not eager.states[0].E.any() and not eager.states[0].u.any()


def test_a_round_the_transport_keeps_home_is_reported_at_once_without_a_jump():
    """A round not launched (alone, behind) is reported at its launch step, not tau steps later: nothing is in
    flight, so there is no eager jump to undo, its tokens and the error-feedback residual stay for the next one."""
    from peer.outer.codec import get_codec
    from peer.outer.rounds import RoundStatus

    reported = []
    behind = lambda f, r, d: RoundOutcome(f, r, RoundStatus.BEHIND, error="late")  # noqa: E731
    p = torch.nn.Parameter(torch.zeros(8))
    eng = StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=2, tau=1, eager=True),
                          ScriptedTransport(behind), group_size_hint=lambda: 2,
                          on_outcome=lambda frag, st, o, step: reported.append((o.status, o.launch_step, step)),
                          error_feedback_codec=get_codec("e3m0"))
    with torch.no_grad():
        p -= 1.0
    eng.add_tokens(10)
    eng.launch_due(2)
    assert reported == [(RoundStatus.BEHIND, 2, 2)]  # at launch
    assert eng.pending[0] == [] and eng.states[0].round == 1 and eng.states[0].tokens_since_sync == 10
    torch.testing.assert_close(p.detach(), torch.full((8,), -1.0))  # no eager jump
    assert eng.feedback.terms[0].residual is None  # nothing was sent
    assert eng.states[0].E is None


def test_an_early_aggregate_is_prepared_off_the_training_thread_and_applied_at_launch_plus_tau():
    """The aggregate is in at once: the worker applies it to copies of G, v right away, but the peer's state
    and weights change only at launch + tau (exactly as the synchronous engine: test_streaming_reference)."""
    def full(f, r, d):
        return RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=20.0)

    others = {t for t in threading.enumerate() if t.name.startswith("outer-worker")}  # other tests' engines
    p, eng, _ = one_param_engine(OuterSettings(H=4, tau=2, lr=1.0, momentum=0.0, alpha=0.5), full)
    for step in range(1, 5):
        with torch.no_grad():
            p -= 1.0
        eng.launch_due(step)
        eng.apply_due(step)
    assert eng.pending[0] and eng.pending[0][0].prepared is not None  # launched at 4, due at 6
    prepared = eng.pending[0][0].prepared.result(timeout=10)
    torch.testing.assert_close(prepared.G, torch.full((8,), -4.0))  # G - lr * Delta on the copy
    torch.testing.assert_close(eng.states[0].G, torch.zeros(8))  # the state itself: not yet
    for step in (5, 6):
        with torch.no_grad():
            p -= 1.0
        eng.launch_due(step)
        eng.apply_due(step)
    assert eng.states[0].applied_rounds == [1]
    torch.testing.assert_close(eng.states[0].G, torch.full((8,), -4.0))
    torch.testing.assert_close(p.detach(), torch.full((8,), 0.5 * -6.0 + 0.5 * -4.0))  # alpha merge at step 6
    eng.close()  # its worker thread stops
    assert not any(t.name.startswith("outer-worker") and t.is_alive() and t not in others
                   for t in threading.enumerate())


@pytest.mark.parametrize("tau, eager", [(0, False), (2, True), (4, True)])
def test_applied_states_are_replaced_never_written_and_their_digest_is_taken_once(tau, eager):
    """Every applied state's G, v stay as they were when applied (a published state shares them), and the digest
    each outcome reads (taken on the worker where the aggregate came early) is the digest of what is there."""
    def full(f, r, d):
        return RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=20.0)

    seen = []  # (G, v, their values then, the digest the state gave then)

    def on_outcome(frag, st, outcome, step):
        seen.append((st.G, st.v, st.G.clone(), st.v.clone(), st.digest()))
        if tau < 4:  # alpha = 0, the whole aggregate in: the weights are G (what the merge gives), not a bit else
            assert torch.equal(frag.flat(), st.G)

    p = torch.nn.Parameter(torch.zeros(8))
    eng = StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=4, tau=tau, eager=eager), ScriptedTransport(full),
                          group_size_hint=lambda: 2, on_outcome=on_outcome)
    for step in range(1, 21):
        with torch.no_grad():
            p -= torch.linspace(0.1, 0.8, 8) * step
        eng.launch_due(step)
        eng.apply_due(step)
    eng.close()
    assert len(seen) >= 3 and eng.states[0].applied_rounds
    for G, v, G_then, v_then, digest in seen:
        assert torch.equal(G, G_then) and torch.equal(v, v_then)
        assert digest == digest_of(G_then, v_then)


def test_a_state_digest_is_computed_once_per_state_and_follows_any_change():
    st = FragmentState.from_params(torch.arange(10.0))
    calls = []
    real = state_module.block_digests

    def fresh():  # the digest of what is there now (not counted)
        return state_module.digest_of_blocks(real(st.G, st.v))

    try:
        state_module.block_digests = lambda G, v: calls.append(1) or real(G, v)
        first = st.digest()
        assert st.digest() == first == fresh() and len(calls) == 1  # cached
        st.G[3] += 1.0  # written in place (the engine never does; the cache still sees it)
        assert st.digest() == fresh() != first and len(calls) == 2
        st.v = torch.ones(10)  # replaced
        assert st.digest() == fresh() and len(calls) == 3
        st.remember_blocks(real(st.G, st.v))  # taken elsewhere (the worker, a verified download)
        assert st.digest() == fresh() and len(calls) == 3
        with torch.inference_mode():  # (tensors without a version counter: never taken from the cache)
            st.G = torch.zeros(10)
            assert st.digest() == fresh()
            st.G[0] = 5.0
            assert st.digest() == fresh()
    finally:
        state_module.block_digests = real


def mixed_rounds(f, r, d, kinds=5):
    """Round r of a script that cycles through every way a round ends: whole, half of the aggregate (ok), half
    (partial: applied nowhere), never in (missed), and (``kinds = 5``) kept home by the transport (alone)."""
    kind = ("whole", "half", "partial", "missed", "alone")[(r - 1) % kinds]
    if kind == "whole":
        return RoundOutcome(f, r, "ok", spans=[Span(0, d.numel(), d.clone())], total_weight=20.0)
    if kind in ("half", "partial"):
        return RoundOutcome(f, r, "ok" if kind == "half" else "partial",
                            spans=[Span(0, 4, d[:4].clone()), Span(4, d.numel(), None)], total_weight=20.0)
    return None if kind == "missed" else RoundOutcome(f, r, "alone", group_size=1)


def launch_and_apply(eng: StreamingEngine, step: int, *, no_sync: bool) -> None:
    """One step boundary's launches and applies; ``no_sync``: in CUDA's sync debug mode "error". The device path's
    launch threads hand their rounds to the transport before the applies: a launch thread that a loaded machine
    holds back past ``wait_timeout`` makes its round ``missed`` (as it should), which would make the paths'
    comparison a matter of timing."""
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        eng.launch_due(step)
        # (no name bound to a round here: the test's frame must not keep what the worker frees)
        assert all(pend.handle.launched(timeout=60.0) for queue in eng.pending for pend in queue
                   if isinstance(pend.handle, DeferredLaunch))
        eng.apply_due(step)
    finally:
        if no_sync:
            torch.cuda.set_sync_debug_mode(0)


def run_mixed(settings, device="cpu", state_on_device=False, no_sync=False, steps=26, kinds=5,
              transport=ScriptedTransport, error_feedback=None):
    """Trains one 8-element parameter on ``device`` through :func:`mixed_rounds`; returns what a peer keeps (with
    ``error_feedback``, a codec's name, the residual last). ``no_sync``: every launch and apply after the first runs
    in CUDA's sync debug mode "error"."""
    p = torch.nn.Parameter(torch.zeros(8, device=device))
    statuses = []
    script = lambda f, r, d: mixed_rounds(f, r, d, kinds)  # noqa: E731
    eng = StreamingEngine([Fragment(0, ["w"], [p])], settings, transport(script),
                          group_size_hint=lambda: 2, state_on_device=state_on_device,
                          error_feedback_codec=None if error_feedback is None else get_codec(error_feedback),
                          on_outcome=lambda frag, st, outcome, step: statuses.append((outcome.round, outcome.status)))
    for step in range(1, steps + 1):
        with torch.no_grad():
            p -= torch.linspace(0.1, 0.8, 8, device=device) * step
        eng.add_tokens(10)
        launch_and_apply(eng, step, no_sync=no_sync and step > 2)
    eng.drain(steps)
    eng.close()
    st = eng.states[0]
    kept = (p.detach().cpu(), st.G.clone(), st.v.clone(), st.tokens_since_sync, st.round, list(st.applied_rounds),
            sorted(statuses))
    if eng.feedback is None:
        return kept
    return (*kept, eng.feedback.terms[0].residual.cpu())


@pytest.mark.parametrize("merge, alpha, eager", [("alpha", 0.0, True), ("alpha", 0.25, True), ("replay", 0.25, True),
                                                 ("alpha", 0.0, False)])
def test_the_device_path_gives_the_host_path_bit_for_bit(merge, alpha, eager):
    """The device path (G, v copied to the parameters' device; launches handed to the transport from their own
    thread) run on the CPU against the host path: after rounds that end in every way the transport launches, the
    weights, the shared state, the carried tokens and the reported statuses agree bit for bit. With rounds kept
    home too, everything but the weights does, and those differ in rounding only: the device path jumped and
    undid the jump at launch + tau, the host path knew at once and never jumped."""
    settings = OuterSettings(H=4, tau=2, eager=eager, lr=0.7, momentum=0.9, alpha=alpha, merge=merge,
                             wait_timeout=0.05)
    host, device = run_mixed(settings, kinds=4), run_mixed(settings, state_on_device=True, kinds=4)
    for a, b in zip(host, device):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert {status for _, status in host[-1]} == {"ok", "partial", "missed"}
    host, device = run_mixed(settings), run_mixed(settings, state_on_device=True)
    torch.testing.assert_close(host[0], device[0], rtol=1e-6, atol=0)
    for a, b in zip(host[1:], device[1:]):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert {status for _, status in host[-1]} == {"ok", "partial", "missed", "alone"}
    assert torch.equal(device[0], run_mixed(settings, state_on_device=True)[0])  # (not a matter of timing)


def run_fragments(settings, state_on_device, device="cpu", no_sync=False, n=3, steps=40):
    """Trains ``n`` one-parameter fragments on ``device`` through :func:`mixed_rounds` (no round kept home); returns
    the weights and every fragment's shared state and applied rounds, the device copies held after each step,
    and the uploads the training thread made after the start. ``no_sync`` as in :func:`run_mixed`."""
    params = [torch.nn.Parameter(torch.zeros(8, device=device)) for _ in range(n)]
    eng = StreamingEngine([Fragment(i, [f"w{i}"], [q]) for i, q in enumerate(params)], settings,
                          ScriptedTransport(lambda f, r, d: mixed_rounds(f, r, d, kinds=4)), group_size_hint=lambda: 2,
                          state_on_device=state_on_device)
    held, uploads = [], []
    if eng.device_state is not None:
        upload = eng.device_state.upload
        eng.device_state.upload = lambda G, v: uploads.append(threading.current_thread().name) or upload(G, v)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for i, q in enumerate(params):
                q -= torch.linspace(0.1, 0.8, 8, device=device) * (step + i)
        eng.add_tokens(10)
        launch_and_apply(eng, step, no_sync=no_sync and step > 2)
        if eng.device_state is not None:
            held.append(eng.device_state.resident())
    eng.drain(steps)
    eng.close()
    kept = [(q.detach().cpu(), st.G.cpu(), st.v.cpu(), list(st.applied_rounds)) for q, st in zip(params, eng.states)]
    return kept, held, uploads


def same(a, b) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("tau", [1, 3])
def test_a_rolling_residency_holds_the_rounds_in_flight_and_gives_the_same_bits(tau):
    """Where the card has no room for every fragment's copy, the device path keeps those with a round in flight and
    the next to launch, which the worker fetches ahead of its launch: the same weights and shared state as every
    copy kept (and as the host path), at a step boundary the copies of the rounds in flight (a fragment launches
    every 2 steps, a round lasts ``tau``) and the next fragment's, and no upload by the training thread after the
    start."""
    settings = OuterSettings(H=6, tau=tau, eager=True, lr=0.7, momentum=0.9, wait_timeout=0.05)
    host, _, _ = run_fragments(settings, False)
    every, held_every, _ = run_fragments(settings, True)
    rolling, held, uploads = run_fragments(settings, "rolling")
    for a, b, c in zip(host, every, rolling):
        assert same(a, b) and same(b, c)
    assert all(len(applied) >= 4 for *_, applied in rolling)
    assert held_every == [3] * len(held_every)
    assert max(held) == -(-tau // 2) + 1 and min(held) >= 1
    assert max(held) <= rolling_copies(tau, 6, 3)  # (what a card must have room for)
    assert uploads == []


@pytest.mark.parametrize("state_on_device", [False, True])
def test_aggregates_handed_over_on_arrival_give_the_same_bits(state_on_device):
    """Rounds whose handles are futures (the swarm's) have their aggregates prepared by a done callback instead
    of at the next step boundary: the same weights, state, tokens and statuses as the polled handles give."""
    settings = OuterSettings(H=4, tau=2, eager=True, lr=0.7, momentum=0.9, wait_timeout=0.05)
    polled = run_mixed(settings, state_on_device=state_on_device)
    on_arrival = run_mixed(settings, state_on_device=state_on_device, transport=FutureTransport)
    for a, b in zip(polled, on_arrival):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


class DoneOnSubscribe(concurrent.futures.Future):
    """A handle that completes as soon as someone subscribes to it: its callback is kept (as a swarm round's is,
    which completes later), and runs at once."""

    def __init__(self, outcome):
        super().__init__()
        self._outcome = outcome

    def add_done_callback(self, fn):
        super().add_done_callback(fn)
        if not self.done():
            self.set_result(self._outcome)


def step_one_param(eng: StreamingEngine, p: torch.nn.Parameter, steps) -> None:
    """Inner steps that move ``p`` by ``0.1 * step``, each followed by its launches and applies."""
    for step in steps:
        with torch.no_grad():
            p -= 0.1 * step
        eng.add_tokens(10)
        launch_and_apply(eng, step, no_sync=False)


@pytest.mark.parametrize("state_on_device", [False, True])
def test_a_round_leaves_no_reference_cycle_that_holds_its_tensors(state_on_device):
    """A round's delta, aggregate and prepared state are freed by reference counting once the round has left the
    engine: no cycle (a handle keeps its done callbacks, which must not refer back to the round) keeps them until
    the cyclic GC runs, which for a large model would hold gigabytes of host memory between collections."""

    class Transport:  # (keeps nothing: only the engine holds a round's handle)
        def launch(self, *, fragment, round_, delta, weight, step, expected_round, base=None):
            return DoneOnSubscribe(RoundOutcome(fragment, round_, "ok", spans=[Span(0, delta.numel(), delta.clone())],
                                                total_weight=20.0))

    settings = OuterSettings(H=4, tau=2, eager=True, lr=0.7, momentum=0.9, wait_timeout=0.05)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        p = torch.nn.Parameter(torch.zeros(8))
        eng = StreamingEngine([Fragment(0, ["w"], [p])], settings, Transport(), group_size_hint=lambda: 2,
                              state_on_device=state_on_device)
        step_one_param(eng, p, range(1, 27))
        applied = list(eng.states[0].applied_rounds)
        gc.collect()  # (while the engine lives: it is one object graph for the whole run, its rounds are not)
        held = [o for o in gc.garbage if issubclass(type(o), torch.Tensor)]  # (type(): a dead weakref proxy raises)
        eng.close()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert len(applied) >= 5  # (the rounds were applied: their handles were subscribed to and completed)
    assert held == []


@pytest.mark.parametrize("state_on_device", [False, True])
def test_the_state_and_aggregate_an_apply_replaces_are_freed_on_the_worker(state_on_device):
    """Freeing a host vector is page unmapping that grows with its size (~20 ms for a 1B model's 640 MB fragment):
    the ``G, v`` an apply replaces and the round's aggregate are freed on the engine's worker, not in the
    training thread's apply."""
    freed: list[tuple[str, str]] = []

    def watch(tensor: torch.Tensor, what: str) -> None:
        weakref.finalize(tensor, lambda: freed.append((what, threading.current_thread().name)))

    class Transport:
        def launch(self, *, fragment, round_, delta, weight, step, expected_round, base=None):
            average = delta.clone()
            watch(average, "aggregate")
            return DoneOnSubscribe(RoundOutcome(fragment, round_, "ok", spans=[Span(0, delta.numel(), average)],
                                                total_weight=20.0))

    settings = OuterSettings(H=4, tau=2, eager=True, lr=0.7, momentum=0.9, wait_timeout=5.0)
    p = torch.nn.Parameter(torch.zeros(8))
    eng = StreamingEngine([Fragment(0, ["w"], [p])], settings, Transport(), group_size_hint=lambda: 2,
                          state_on_device=state_on_device)
    last: dict[str, weakref.ref] = {}  # (not ids: a freed tensor's id is reused by the next one)
    for step in range(1, 27):
        step_one_param(eng, p, [step])
        for name in ("G", "v"):
            t = getattr(eng.states[0], name)
            if name not in last or last[name]() is not t:
                last[name] = weakref.ref(t)
                watch(t, name)
    eng.worker.submit(lambda: None).result()  # (its queue, the releases in it included, has run)
    seen = list(freed)  # (not what close frees: the round still in flight)
    eng.close()
    assert {what for what, _ in seen} == {"G", "v", "aggregate"}
    assert len([1 for what, _ in seen if what == "G"]) >= 4
    assert [(what, thread) for what, thread in seen if not thread.startswith("outer-worker")] == []


@pytest.mark.parametrize("at_once", [False, True])
@pytest.mark.parametrize("state_on_device", [False, True])
def test_an_aggregate_goes_to_the_worker_when_it_arrives_not_at_the_next_step(state_on_device, at_once):
    """``at_once``: the transport's future is done when it hands it over (the device path's launch thread then
    forwards the outcome itself); else another thread completes it later."""
    tr = FutureTransport(lambda f, r, d: RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=20.0),
                         at_once=at_once)
    p = torch.nn.Parameter(torch.zeros(8))
    eng = StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=2, tau=1, wait_timeout=5.0), tr,
                          group_size_hint=lambda: 2, state_on_device=state_on_device)
    try:
        with torch.no_grad():
            p -= 1.0
        eng.launch_due(2)
        pend = eng.pending[0][0]
        if state_on_device:
            pend.handle._launched.result(timeout=5)  # (the launch thread is done: launched and forwarded)
        if not at_once:
            assert pend.prepared is None
            future, outcome = tr.futures[0]
            arrival = threading.Thread(target=future.set_result, args=(outcome,))
            arrival.start()
            arrival.join(5)
        assert pend.prepared is not None and pend.answered  # no step boundary in between
        prepared = pend.prepared.result(timeout=5)
        eng.apply_due(3)
        assert eng.states[0].G is prepared.G and eng.states[0].applied_rounds == [1]
    finally:
        eng.close()


@pytest.mark.parametrize("codec", ["e3m0", "topk32"])
def test_the_device_path_with_error_feedback_gives_the_host_path_bit_for_bit(codec, monkeypatch):
    """Error feedback on the device path, on the CPU, against the host path: the residual is added to Delta on the
    device from the worker's copy (the host residual is not copied at a launch: counted), updated from Delta's host
    copy, put back where a round delivered nothing and, for a round the transport kept home, everywhere. The
    weights, the shared state, the tokens, the statuses and the residual agree bit for bit (the weights within
    rounding where rounds were kept home, as without error feedback)."""
    settings = OuterSettings(H=4, tau=2, eager=True, lr=0.7, momentum=0.9, wait_timeout=0.05)
    fallback = []
    real = ErrorFeedback.compensate

    def counted(self, delta, out=None):
        fallback.append(self.residual is not None)
        return real(self, delta, out=out)

    host = run_mixed(settings, kinds=4, error_feedback=codec)
    monkeypatch.setattr(ErrorFeedback, "compensate", counted)
    device = run_mixed(settings, state_on_device=True, kinds=4, error_feedback=codec)
    for a, b in zip(host, device, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert float(host[-1].abs().sum()) > 0 and {s for _, s in host[-2]} == {"ok", "partial", "missed"}
    assert fallback and not any(fallback)  # (only launches without a residual yet took the host's)
    host = run_mixed(settings, error_feedback=codec)
    device = run_mixed(settings, state_on_device=True, error_feedback=codec)
    torch.testing.assert_close(host[0], device[0], rtol=1e-6, atol=0)
    for a, b in zip(host[1:], device[1:], strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert "alone" in {s for _, s in host[-2]}


def test_the_device_path_is_refused_where_its_terms_live_on_the_host():
    p = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="tau < H"):
        StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=4, tau=4), ScriptedTransport(mixed_rounds),
                        state_on_device=True)


@pytest.mark.parametrize("network_seconds", [0.0, 30.0])
def test_an_applied_round_says_how_long_it_took_to_be_ready(network_seconds):
    """``RoundOutcome.ready_seconds`` (what ``tau = auto`` must hide): from the launch until the aggregate was
    applied to copies of the state, the worker's preparation included; never less than the round's own
    ``seconds``, and within the wall time the run took."""
    def whole(f, r, d):
        return RoundOutcome(f, r, "ok", spans=[Span(0, d.numel(), d.clone())], total_weight=20.0,
                            seconds=network_seconds)

    seen = []
    p = torch.nn.Parameter(torch.zeros(8))
    eng = StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=4, tau=2, eager=True, wait_timeout=5.0),
                          FutureTransport(whole), group_size_hint=lambda: 2,
                          on_outcome=lambda frag, st, outcome, step: seen.append(outcome.ready_seconds))
    t0 = time.monotonic()
    try:
        step_one_param(eng, p, range(1, 14))
    finally:
        eng.close()
    elapsed = time.monotonic() - t0
    assert len(seen) >= 2
    assert all(0 < s <= max(elapsed, network_seconds) and s >= network_seconds for s in seen), (seen, elapsed)


def test_waiting_for_an_event_asks_it_less_and_less_often(monkeypatch):
    """wait_for's pauses between two questions to an event double from 0.5 ms up to 4 ms (each wake-up takes the
    GIL from a training thread that may be bound by its host); it returns as soon as the event says done."""
    from peer.outer import device_state

    pauses: list[float] = []
    monkeypatch.setattr(device_state.time, "sleep", pauses.append)

    class Event:
        asked = 0

        def query(self):
            self.asked += 1
            return self.asked > 7

    event = Event()
    device_state.wait_for(event)
    assert event.asked == 8 and pauses == [0.0005, 0.001, 0.002, 0.004, 0.004, 0.004, 0.004]
    device_state.wait_for(None)
    assert len(pauses) == 7


def test_a_deferred_launch_cancelled_before_it_runs_cancels_the_transports_handle():
    import concurrent.futures

    from peer.outer.device_state import DeferredLaunch

    gate, cancelled = threading.Event(), []

    class Slow:
        def result(self, timeout=None):
            raise TimeoutError

        def done(self):
            return False

        def cancel(self):
            cancelled.append(1)
            return True

    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        started = threading.Event()
        handle = DeferredLaunch(pool, None, lambda: started.set() or gate.wait(5) and Slow())
        assert started.wait(5)
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.01)
        assert not handle.done() and not handle.cancel()  # the launch is running: cancelled when it returns
        gate.set()
    finally:
        pool.shutdown(wait=True)
    assert cancelled == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/gpu.py runs it on one)")
@pytest.mark.parametrize("state_on_device", [False, True])
@pytest.mark.parametrize("merge, alpha", [("alpha", 0.25), ("replay", 0.25), ("alpha", 0.0)])
def test_cuda_engine_gives_the_cpu_engine_bit_for_bit_and_applies_without_waiting(merge, alpha, state_on_device):
    """The same rounds (whole ones, ones with half of the aggregate missing, partial ones: applied nowhere, the
    eager jumps undone) on a CUDA parameter and a CPU one: the weights and G agree bit for bit (the merge runs on
    the device with the same elementwise operations). The applies, which come after the aggregate is in, make no
    synchronizing call; on the device path the launches make none either."""
    def half(f, r, d):
        if r % 3 == 1:
            return RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=20.0)
        return RoundOutcome(f, r, "ok" if r % 3 == 2 else "partial",
                            spans=[Span(0, 4, d[:4].clone()), Span(4, 8, None)], total_weight=20.0)

    settings = OuterSettings(H=4, tau=2, eager=True, lr=0.7, momentum=0.9, alpha=alpha, merge=merge,
                             wait_timeout=0.01)
    runs = []
    for device in ("cpu", "cuda"):
        p = torch.nn.Parameter(torch.zeros(8, device=device))
        eng = StreamingEngine([Fragment(0, ["w"], [p])], settings, ScriptedTransport(half),
                              group_size_hint=lambda: 2, state_on_device=state_on_device and device == "cuda")
        for step in range(1, 17):  # rounds 1 (whole), 2 (half), 3 (partial) applied
            with torch.no_grad():
                p -= torch.linspace(0.1, 0.8, 8, device=device) * step
            if device == "cuda" and state_on_device and step > 4:
                torch.cuda.set_sync_debug_mode("error")
            try:
                eng.launch_due(step)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            if device == "cuda" and step % 4 == 2:  # an apply step (launch + tau), its aggregate prepared
                torch.cuda.set_sync_debug_mode("error")
            try:
                eng.apply_due(step)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        eng.close()
        runs.append((p.detach().cpu(), eng.states[0].G.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/gpu.py runs it on one)")
@pytest.mark.parametrize("merge, alpha, eager", [("alpha", 0.0, True), ("replay", 0.25, True), ("alpha", 0.0, False)])
def test_cuda_device_path_gives_the_cpu_host_path_bit_for_bit_through_every_ending(merge, alpha, eager):
    """:func:`run_mixed` (whole, half, partial, missed and kept-home rounds) through the device path on the CPU and
    on CUDA, whose launches and applies after the first make no synchronizing call: the same bits."""
    settings = OuterSettings(H=4, tau=2, eager=eager, lr=0.7, momentum=0.9, alpha=alpha, merge=merge,
                             wait_timeout=0.05)
    cpu = run_mixed(settings, state_on_device=True)
    cuda = run_mixed(settings, device="cuda", state_on_device=True, no_sync=True)
    for a, b in zip(cpu, cuda):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/gpu.py runs it on one)")
@pytest.mark.parametrize("codec", ["e3m0", "topk32"])
def test_cuda_device_path_with_error_feedback_gives_the_cpu_bits_without_waiting(codec):
    """:func:`run_mixed` with error feedback through the device path on the CPU and on CUDA: the same bits, the
    residual included, and no launch or apply after the first makes a synchronizing call (the residual reaches the
    device through the worker's copy, not a copy at the launch)."""
    settings = OuterSettings(H=4, tau=2, eager=True, lr=0.7, momentum=0.9, wait_timeout=0.05)
    cpu = run_mixed(settings, state_on_device=True, error_feedback=codec)
    cuda = run_mixed(settings, device="cuda", state_on_device=True, no_sync=True, error_feedback=codec)
    for a, b in zip(cpu, cuda, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (bench/gpu.py runs it on one)")
def test_cuda_rolling_residency_gives_the_cpu_host_path_bit_for_bit_without_waiting():
    """:func:`run_fragments` through the rolling residency on CUDA (copies fetched by the worker through the pinned
    staging, dropped after their apply), its launches and applies after the first making no synchronizing call:
    the CPU host path's bits, and no upload by the training thread after the start."""
    settings = OuterSettings(H=6, tau=3, eager=True, lr=0.7, momentum=0.9, wait_timeout=0.05)
    cpu, _, _ = run_fragments(settings, False)
    cuda, held, uploads = run_fragments(settings, "rolling", device="cuda", no_sync=True)
    for a, b in zip(cpu, cuda):
        assert same(a, b)
    assert max(held) == -(-settings.tau // 2) + 1 and uploads == []  # (rounds in flight and the next, as on the CPU)


def test_error_feedback_residual_is_put_back_where_a_launched_round_delivered_nothing():
    """Error feedback: a round that is not applied (partial) carries its progress in S - theta to the next round, so
    the residual must be the one from before that launch (else the next round sends that quantization error
    twice)."""
    from peer.outer.codec import get_codec, roundtrip

    def script(f, r, d):
        if r == 1:
            return RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=20.0)
        return RoundOutcome(f, r, "partial", spans=[Span(0, 4, d[:4].clone()), Span(4, 8, None)], total_weight=20.0)

    codec = get_codec("e3m0")
    p = torch.nn.Parameter(torch.zeros(8))
    tr = ScriptedTransport(script)
    eng = StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=2, tau=1, wait_timeout=1.0), tr,
                          group_size_hint=lambda: 2, error_feedback_codec=codec)
    for step in range(1, 6):
        with torch.no_grad():
            p -= torch.linspace(0.13, 0.97, 8)
        eng.add_tokens(10)
        eng.launch_due(step)
        eng.apply_due(step)
        if step == 3:  # round 1 applied: its residual is the codec's error of what it sent
            sent1 = tr.launched[0][2]
            first = sent1 - roundtrip(sent1, codec)
            torch.testing.assert_close(eng.feedback.terms[0].residual, first)
    eng.close()  # round 2 was partial: applied nowhere, its residual is the one from before its launch
    torch.testing.assert_close(eng.feedback.terms[0].residual, first)


def test_error_feedback_residual_goes_with_an_adopted_state_and_comes_back_when_rounds_are_given_up():
    from peer.outer.codec import get_codec

    p = torch.nn.Parameter(torch.zeros(8))
    eng = StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=2, tau=1, wait_timeout=0.01),
                          ScriptedTransport(lambda f, r, d: None), group_size_hint=lambda: 2,
                          error_feedback_codec=get_codec("e3m0"))
    with torch.no_grad():
        p -= 0.37
    eng.launch_due(2)  # in flight, never arrives
    eng.feedback.settle()
    assert eng.feedback.terms[0].residual is not None
    eng.abandon()  # a stop: nothing was received, nothing of its residual stays
    assert eng.feedback.terms[0].residual is None
    eng.launch_due(4)
    eng.adopt(0, torch.ones(8), torch.zeros(8), 3)  # a download replaces the state and drops local progress
    assert eng.feedback.terms[0].residual is None
    eng.close()


def test_host_buffers_hand_out_views_and_take_back_only_their_own():
    pool = HostBuffers(16, keep=2)
    a, b, c = pool.take(16), pool.take(8), pool.take(4)
    assert (a.numel(), b.numel(), c.numel(), pool.allocated) == (16, 8, 4, 3)
    pool.give(a, torch.empty(16), None, b, c)  # a foreign tensor and None are ignored; c is over keep
    d, e = pool.take(16), pool.take(3)
    assert pool.allocated == 3 and {d.data_ptr(), e.data_ptr()} == {a.data_ptr(), b.data_ptr()}
    pool.give(e, e)  # twice: taken back once
    assert pool.take(1).data_ptr() == e.data_ptr() and pool.take(1) is not None and pool.allocated == 4
    with pytest.raises(ValueError, match="17 elements"):
        pool.take(17)


def train_and_sync(p, eng, steps):
    """``steps`` steps of "training" (p moves by 0.1 x step), each followed by the engine's launches and applies;
    then the engine is closed."""
    for step in range(1, steps + 1):
        with torch.no_grad():
            p -= 0.1 * step
        eng.launch_due(step)
        eng.apply_due(step)
    eng.close()


@pytest.mark.parametrize("tau, eager", [(0, False), (2, True), (4, False)])
def test_launches_reuse_their_host_vectors_once_rounds_are_over(tau, eager):
    """Steady state: a launch takes its snapshot, Delta and scratch vectors from the engine's pool (a fresh
    fragment-sized vector costs page faults): one round in flight needs at most three."""
    def full(f, r, d):
        return RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=20.0)

    p, eng, _ = one_param_engine(OuterSettings(H=4, tau=tau, eager=eager, lr=0.7, momentum=0.9), full)
    train_and_sync(p, eng, 40)
    assert eng.states[0].applied_rounds[-1] >= 9 and 1 <= eng.buffers.allocated <= 3


def test_a_delta_the_transport_never_answered_for_is_not_reused():
    """A round given up at its deadline may still be sending its Delta (the transport's contract: Delta is not
    modified until the round's future is done): later launches must not write into it."""
    held = []

    class NeverAnswers(ScriptedTransport):
        def launch(self, *, delta, **kw):
            held.append((delta, delta.clone()))
            return super().launch(delta=delta, **kw)

    p = torch.nn.Parameter(torch.zeros(8))
    eng = StreamingEngine([Fragment(0, ["w"], [p])], OuterSettings(H=2, tau=1, eager=True, wait_timeout=0.01),
                          NeverAnswers(lambda f, r, d: None), group_size_hint=lambda: 2)
    train_and_sync(p, eng, 12)
    assert len(held) == 6 and all(torch.equal(sent, copy) for sent, copy in held)
