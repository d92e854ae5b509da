"""Quality at small scale: the paper-parity ablations of the outer algorithm, same model and tokens.

    .venv/bin/python bench/quality.py                 # 16 methods x 2 seeds + the loopback swarm: 6-15 min
    .venv/bin/python bench/quality.py --quick         # 102 instead of 166 steps, no swarm: ~60% of the CPU time
    .venv/bin/python bench/quality.py --extra         # also tau = 5 with the alpha = 0 merge, with and without eager
    .venv/bin/python bench/quality.py --replot runs/bench_quality/results.json   # table + plot again

(6-15 min: on 2 CPU cores shared with other work, with 2 jobs.) Every method trains the same model
(``--preset``, default tiny) on the built-in synthetic Markov corpus (``peer.local.markov.MarkovSource`` at
``--vocab-size`` 64, whose entropy rate is the best achievable CE) for the same
number of inner steps and tokens per peer, in the in-process simulator (``peer.outer.simulator``: M
replicas, each a real :class:`peer.streaming.StreamingEngine`, one :class:`FakeTransport` that
averages exactly, through the wire codec). The methods (issue 7):

1. data-parallel: one model stepped with the M replicas' batches together, i.e. their gradients
   averaged every step (same AdamW settings, same tokens);
2. DiLoCo: P = 1, tau = 0, fp32;  3. Streaming DiLoCo: P = 2 strided fragments, fp32;
4. + FP4 E3M0 on the wire, without and with error feedback;
5. + overlap tau in {1, 5}: alpha = 0.5 merge and the replay merge, and tau = 5 replay + eager
   (the full method);
6. tau = H: eager (Alg. 3) vs naive delayed, each at outer lr 0.7 and 0.7 / 4 (the eager paper lowered
   the naive method's outer lr 4x for stability);
7. sequential instead of strided fragments;  8. heterogeneous tau across peers (0, 5, 0, 5).

Seeds: seed s sets the initial weights (``torch.manual_seed(s)`` before every replica's model, so
all replicas and all methods of seed s start from the same theta_0) and the data shards (replica m
reads shard ``100 s + m``); the corpus itself (data seed 1234) and the held-out set (shard 10000)
are the same for every run. Eval loss = mean over the M replicas of each replica's CE on the
held-out set (for data-parallel: the one model); "shared" = the CE of the shared model (every fragment's G,
what a run is judged by). Runs end ``k H + 6`` steps in, so every round with
tau <= 5 has been applied and every method's models are 6 local steps past fragment 0's last sync; the
curves are evaluated every H steps in the same phase (on the first 32 held-out sequences).

``--swarm`` (on by default, off with ``--quick``) also trains the full method as M real
``swarm-peer`` processes on 127.0.0.1 (bootstrap node + peers, the steps schedule, the same settings
and seed 0's init and shards) and evaluates each peer's final checkpoint on the same held-out set.

Bytes per peer: what a peer sends in a butterfly all-reduce, 2 (M-1) / M encoded vectors per round
(from ``FakeTransport.bytes_per_round``, which holds the M encoded parts and the encoded average once per
replica); data-parallel sends one fp32 gradient per step that way. The swarm's is measured
(``bytes_sent`` of its round events).

``--text DIR``: real text instead of the synthetic corpus: ``swarm-peer prepare-data``'s output (its vocabulary
is the model's); replica m of seed s reads shard m of M from an offset of its own, the eval set is the corpus'
held-out last ``TEXT_HOLDOUT`` (``TokenSource.held_out``, as a peer's evaluation), and there is no entropy floor
(the table's "gap" is then the CE itself). ``--stdlib-text DIR`` first writes Python's standard library sources as
one .txt file and prepares it into DIR (a BPE of ``--vocab-size``), unless DIR already holds it.

Writes ``results.json`` into ``--out-dir`` and the loss curves to ``--plot`` (matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peer.config.fields import SPARSE_OUTER_STEP  # noqa: E402
from peer.outer.codec import get_codec  # noqa: E402
from peer.local.data import TokenShardSource  # noqa: E402
from peer.local.markov import MarkovSource  # noqa: E402
from peer.outer.fragments import partition  # noqa: E402
from peer.local.inner import InnerLoop, mean_ce  # noqa: E402
from peer.run.evaluation import shared_params  # noqa: E402
from peer.local.model import build_model, count_parameters  # noqa: E402
from peer.outer.aggregate import AggregationRule  # noqa: E402
from peer.outer.simulator import FakeTransport, Replica, run_lockstep  # noqa: E402
from peer.outer.engine import StreamingEngine  # noqa: E402
from peer.outer.settings import OuterSettings  # noqa: E402

EVAL_SHARD = 10_000
TEXT_HOLDOUT = 0.02  # of a --text corpus: the held-out tokens the table's eval CE is measured on
SHARD_STRIDE = 100  # replica m of seed s reads shard SHARD_STRIDE * s + m


@dataclass(frozen=True)
class Method:
    key: str
    item: str  # the issue's numbering
    label: str
    dp: bool = False
    fragment_blocks: Optional[int] = None  # None: Setup.fragment_blocks; 0: one fragment (P = 1)
    pattern: str = "strided"
    codec: str = "fp32"
    error_feedback: bool = False
    tau: tuple = (0,)  # per replica, cycled; "H" = the sync interval
    alpha: float = 0.0
    merge: str = "alpha"
    eager: bool = False
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    aggregator: str = "mean"  # how the reducer combines parts: mean, or clipped (the robust default of a swarm)

    def blocks_per_fragment(self, setup: "Setup") -> int:
        return setup.fragment_blocks if self.fragment_blocks is None else self.fragment_blocks

    def tau_of(self, m: int, H: int) -> int:
        t = self.tau[m % len(self.tau)]
        return H if t == "H" else int(t)


# The outer optimizer for sparse codecs, what outer.lr / momentum = auto take (peer/config/fields.py says why)
SPARSE_OUTER = dict(outer_lr=SPARSE_OUTER_STEP[0], outer_momentum=SPARSE_OUTER_STEP[1])

METHODS: list[Method] = [
    Method("dp", "1", "data-parallel (grads averaged every step)", dp=True),
    Method("diloco", "2", "DiLoCo: P=1, tau=0, fp32", fragment_blocks=0),
    Method("streaming", "3", "Streaming: P=2 strided, tau=0, fp32"),
    Method("fp4", "4", "Streaming + FP4 e3m0", codec="e3m0"),
    Method("fp4_ef", "4", "Streaming + FP4 e3m0 + error feedback", codec="e3m0", error_feedback=True),
    Method("tau1_alpha", "5", "+ FP4, tau=1, alpha=0.5 merge", codec="e3m0", tau=(1,), alpha=0.5),
    Method("tau5_alpha", "5", "+ FP4, tau=5, alpha=0.5 merge", codec="e3m0", tau=(5,), alpha=0.5),
    Method("tau1_replay", "5", "+ FP4, tau=1, replay merge", codec="e3m0", tau=(1,), merge="replay"),
    Method("tau5_replay", "5", "+ FP4, tau=5, replay merge", codec="e3m0", tau=(5,), merge="replay"),
    Method("full", "5", "full: FP4, tau=5, replay, eager", codec="e3m0", tau=(5,), merge="replay", eager=True),
    Method("full_clipped", "13", "full + robust aggregation (clipped, the swarm default)", codec="e3m0", tau=(5,),
           merge="replay", eager=True, aggregator="clipped"),
    Method("tauH_eager", "6", "FP4, tau=H, eager (Alg. 3)", codec="e3m0", tau=("H",), eager=True),
    Method("tauH_eager_lr", "6", "FP4, tau=H, eager, outer lr 0.175", codec="e3m0", tau=("H",), eager=True,
           outer_lr=0.175),
    Method("tauH_naive", "6", "FP4, tau=H, naive delayed, outer lr 0.7", codec="e3m0", tau=("H",)),
    Method("tauH_naive_lr", "6", "FP4, tau=H, naive delayed, outer lr 0.175", codec="e3m0", tau=("H",),
           outer_lr=0.175),
    Method("sequential", "7", "Streaming fp32, sequential fragments", pattern="sequential"),
    Method("hetero_tau", "8", "full, tau = 0,5,0,5 across peers", codec="e3m0", tau=(0, 5), merge="replay",
           eager=True),
]
# Not in the default list (--extra): the config's default merge (alpha = 0: the tau local steps are dropped when
# the aggregate arrives) with overlap, with and without eager; the full method as bench/utilization.py runs it.
EXTRA: list[Method] = [
    Method("tau5_alpha0", "5", "+ FP4, tau=5, alpha=0 merge", codec="e3m0", tau=(5,)),
    Method("full_alpha0", "5", "FP4, tau=5, alpha=0 merge, eager", codec="e3m0", tau=(5,), eager=True),
    # issue 31: sparse codecs (the k largest of every 4096 elements, with error feedback, which they need)
    *[Method(f"topk{k}_ef", "31", f"Streaming + top-{k}/4096 + error feedback", codec=f"topk{k}", error_feedback=True)
      for k in (32, 64, 128)],
    # the same with the outer optimizer the sparse codecs want (SPARSE_OUTER)
    *[Method(f"topk{k}_outer", "31", f"Streaming + top-{k}/4096 + error feedback, outer Nesterov "
             f"{SPARSE_OUTER['outer_lr']:g} / {SPARSE_OUTER['outer_momentum']:g}", codec=f"topk{k}",
             error_feedback=True, **SPARSE_OUTER)
      for k in (32, 64, 128)],
]
BY_KEY = {m.key: m for m in METHODS + EXTRA}


@dataclass
class Setup:
    replicas: int = 4
    preset: str = "tiny"
    factory: str = ""  # a model factory "module:callable" instead of the preset (the test's smaller model)
    fragment_blocks: int = 3  # k of the streaming methods (tiny: 6 blocks -> P = 2)
    seq_len: int = 32
    batch_size: int = 4
    H: int = 20
    rounds: int = 8  # steps = rounds * H + tail
    tail: int = 6  # > the largest tau < H: every such round is applied by the end (if H / P > tail)
    inner_lr: float = 3e-3
    warmup_steps: int = 20
    data_seed: int = 1234
    vocab_size: int = 64
    text: str = ""  # a prepared corpus (swarm-peer prepare-data) instead of the synthetic one
    eval_seqs: int = 128  # the final eval (the table)
    # the robust rule of methods with aggregator="clipped" (peer/outer/aggregate.py; bench/attacks.py varies them)
    clip_factor: float = AggregationRule().clip_factor
    weight_cap: float = AggregationRule().weight_cap
    clip_iterations: int = AggregationRule().iterations
    curve_seqs: int = 32  # the eval points of the curves: the first curve_seqs of the same held-out set

    @property
    def steps(self) -> int:
        return self.rounds * self.H + self.tail

    @property
    def eval_points(self) -> list[int]:
        """Steps of the curves' eval points: every H steps in the phase of the last step (tail steps past a
        sync of fragment 0, like the final eval), so no method is caught at a more favourable moment."""
        return list(range(self.steps % self.H or self.H, self.steps + 1, self.H))

    def build(self, seed: int) -> tuple[torch.nn.Module, list]:
        torch.manual_seed(seed)  # the same theta_0 for every replica and every method of this seed
        return build_model(self.preset, self.vocab_size, self.seq_len, self.factory or None)


@dataclass
class RunResult:
    method: str
    seed: int
    steps: list[int] = field(default_factory=list)  # eval points (0 = initial weights)
    eval_ce: list[float] = field(default_factory=list)  # mean over replicas
    train_ce: list[float] = field(default_factory=list)  # mean over replicas and the steps since the last point
    final: float = math.nan
    final_replica0: float = math.nan
    final_honest: float = math.nan  # over the replicas that do not tamper with their parts (bench/attacks.py)
    final_shared: float = math.nan  # the shared model: every fragment's G (the same on every replica), not theta
    excluded: dict = field(default_factory=dict)  # replica -> round it was excluded at (with a robust rule)
    bytes_per_peer: float = 0.0
    rounds: int = 0
    finite: bool = True
    error: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------ the simulator runs
def make_inner(model: torch.nn.Module, setup: Setup) -> InnerLoop:
    """The demo's AdamW inner loop (configs/demo.toml), cosine to the run's last step."""
    return InnerLoop(model, lr=setup.inner_lr, weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=setup.warmup_steps,
                     total_steps=setup.steps, min_lr_ratio=0.1, grad_clip=1.0, z_loss=1e-4,
                     device=torch.device("cpu"))


def eval_batch(setup: Setup) -> torch.Tensor:
    if setup.text:
        held = text_source(setup, 0, 0, 1).held_out(setup.eval_seqs, setup.seq_len)
        if held is None:
            raise ValueError(f"{setup.text}: too short to hold out {setup.eval_seqs} sequences")
        return held
    return MarkovSource(setup.vocab_size, setup.data_seed, EVAL_SHARD).next_batch(setup.eval_seqs, setup.seq_len)


def text_source(setup: Setup, seed: int, shard: int, shards: int) -> TokenShardSource:
    return TokenShardSource(setup.text, setup.vocab_size, setup.data_seed + seed, shard, shards,
                            verify_checksums=False, holdout=TEXT_HOLDOUT)


def training_sources(setup: Setup, seed: int) -> list:
    """Replica m's data: its shard of the synthetic corpus, or of the --text corpus' training tokens."""
    M = setup.replicas
    if setup.text:
        return [text_source(setup, seed, m, M) for m in range(M)]
    return [MarkovSource(setup.vocab_size, setup.data_seed, SHARD_STRIDE * seed + m) for m in range(M)]


def prepare_stdlib_text(out_dir: Path, vocab_size: int) -> Path:
    """Python's standard library sources (the top-level .py files, sorted) as one .txt document each, prepared
    into ``out_dir`` by ``swarm-peer prepare-data``'s code (a byte-level BPE of ``vocab_size``)."""
    import sysconfig

    from peer.local.prepare import prepare

    if (out_dir / "manifest.json").is_file():
        return out_dir
    src = out_dir.with_name(out_dir.name + "-txt")
    src.mkdir(parents=True, exist_ok=True)
    inputs = []
    for py in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        txt = src / (py.stem + ".txt")
        txt.write_text(py.read_text(encoding="utf-8", errors="replace"))
        inputs.append(txt)
    prepare(inputs, out_dir, vocab_size=vocab_size)
    return out_dir


@torch.no_grad()
def evaluate(model: torch.nn.Module, batch: torch.Tensor) -> float:
    return mean_ce(model, batch, chunk=64)


def shared_ce(model: torch.nn.Module, engine: StreamingEngine, batch: torch.Tensor) -> float:
    """The held-out CE of the shared model: every fragment's ``G`` (the same on every replica) in place of
    ``model``'s own (local) parameters, as the peer's evaluation takes them (:mod:`peer.run.evaluation`)."""
    return mean_ce(model, batch, params=shared_params(engine.fragments, [st.G for st in engine.states]), chunk=64)


def params_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def butterfly_share(M: int) -> float:
    """Encoded vectors a peer sends per round in a butterfly all-reduce: (M-1)/M of its own vector to the other
    reducers, and its reduced span's average ((M-1)/M of numel in all) to the M-1 others."""
    return 2.0 * (M - 1) / M


def fp32_bytes(numel: int) -> int:
    return get_codec("fp32").encode_flat(torch.zeros(numel)).ByteSize()


def run_one(method: Method, setup: Setup, seed: int, tamper: Optional[dict] = None) -> RunResult:
    """Trains one method with one seed in the simulator; never raises for a diverged run (``finite``).
    ``tamper`` (bench/attacks.py): replica index -> what that attacker does to its part; ``final_honest`` is
    then the final eval over the other replicas."""
    torch.set_num_threads(1)
    if not 0 <= seed < EVAL_SHARD // SHARD_STRIDE or setup.replicas > SHARD_STRIDE:
        raise ValueError(f"seed must be in [0, {EVAL_SHARD // SHARD_STRIDE}) and replicas <= {SHARD_STRIDE}")
    t0 = time.perf_counter()
    res = RunResult(method.key, seed)
    M, H, steps = setup.replicas, setup.H, setup.steps
    held_out = eval_batch(setup)
    sources = training_sources(setup, seed)
    losses: list[float] = []

    if method.dp:
        model, _ = setup.build(seed)
        inner = make_inner(model, setup)
        models = [model]

        def step_all(n_steps: int, start: int) -> None:
            for _ in range(n_steps):
                batch = torch.cat([src.next_batch(setup.batch_size, setup.seq_len) for src in sources])
                losses.append(inner.step(batch).ce)  # mean CE over M batches: their gradients averaged
        res.bytes_per_peer = butterfly_share(M) * fp32_bytes(count_parameters(model)) * steps
        engines: list[StreamingEngine] = []
        transport: Optional[FakeTransport] = None
    else:
        rule = AggregationRule(clip_factor=setup.clip_factor, weight_cap=setup.weight_cap,
                               iterations=setup.clip_iterations)
        transport = FakeTransport(M, method.codec, None if method.aggregator == "mean" else rule, tamper=tamper)
        models, engines, sim = [], [], []
        step_ce: list[float] = []
        for m in range(M):
            model, blocks = setup.build(seed)
            inner = make_inner(model, setup)
            frags = partition(model, blocks, method.blocks_per_fragment(setup), method.pattern)
            settings = OuterSettings(H=H, lr=method.outer_lr, momentum=method.outer_momentum, alpha=method.alpha,
                                     tau=method.tau_of(m, H), eager=method.eager, merge=method.merge, wait_timeout=5.0)
            engine = StreamingEngine(frags, settings, transport.endpoint(m), group_size_hint=lambda: M,
                                     error_feedback_codec=get_codec(method.codec) if method.error_feedback else None)

            def inner_step(inner=inner, src=sources[m]) -> int:
                stats = inner.step(src.next_batch(setup.batch_size, setup.seq_len))
                step_ce.append(stats.ce)
                return stats.tokens
            models.append(model)
            engines.append(engine)
            sim.append(Replica(inner_step=inner_step, engine=engine))

        def step_all(n_steps: int, start: int) -> None:
            for t in range(start, start + n_steps):
                run_lockstep(sim, 1, start=t)
                losses.append(sum(step_ce) / len(step_ce))
                step_ce.clear()

    curve_set = held_out[:setup.curve_seqs]

    def record(step: int) -> None:
        values = [evaluate(m, curve_set) for m in models]
        window = losses[res.steps[-1]:step] if res.steps else []  # losses[t - 1] is step t's
        res.steps.append(step)
        res.eval_ce.append(sum(values) / len(values))
        res.train_ce.append(sum(window) / len(window) if window else math.nan)
        if not all(math.isfinite(v) for v in values):
            res.finite = False

    record(0)
    done = 0
    try:
        for point in setup.eval_points:
            step_all(point - done, done)
            done = point
            record(done)
        for engine in engines:  # what a stopping peer keeps (peer/run/trainer.py): rounds in flight are dropped
            engine.abandon()
        finals = [evaluate(m, held_out) for m in models]
        res.finite = res.finite and all(math.isfinite(v) for v in finals)
        res.final = sum(finals) / len(finals)
        res.final_replica0 = finals[0]
        honest = [v for i, v in enumerate(finals) if i not in (tamper or {})]
        res.final_honest = sum(honest) / len(honest)
        if engines:
            res.final_shared = shared_ce(models[0], engines[0], held_out)
    except FloatingPointError as e:  # the inner loop refuses a non-finite loss or gradient
        res.finite, res.error = False, str(e)
    res.finite = res.finite and all(params_finite(m) for m in models) and all(math.isfinite(x) for x in losses)
    if transport is not None:  # bytes_per_round: M parts up + the average down to M replicas, each encoded
        res.bytes_per_peer = butterfly_share(M) * sum(transport.bytes_per_round.values()) / (2 * M)
        res.rounds = len(transport.bytes_per_round)
        res.excluded = dict(transport.excluded)
    res.seconds = time.perf_counter() - t0
    return res


def _run_job(job: tuple[str, dict, int]) -> RunResult:
    key, setup, seed = job
    return run_one(BY_KEY[key], Setup(**setup), seed)


def run_all(methods: Sequence[Method], setup: Setup, seeds: Sequence[int], jobs: int = 1,
            log=print, on_result=lambda results: None) -> list[RunResult]:
    todo = [(m.key, dataclasses.asdict(setup), s) for s in seeds for m in methods]
    results = []
    t0 = time.perf_counter()

    def note(r: RunResult) -> None:
        status = "" if r.finite else f"  NOT FINITE {r.error}"
        log(f"  [{len(results):2d}/{len(todo)}] {r.method:14s} seed {r.seed}: eval CE {r.final:.4f} "
            f"(shared {r.final_shared:.4f}) "
            f"({r.seconds:.0f} s; {time.perf_counter() - t0:.0f} s elapsed){status}")
        on_result(results)

    if jobs <= 1:
        for job in todo:
            results.append(_run_job(job))
            note(results[-1])
    else:
        import multiprocessing as mp
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            for fut in as_completed([pool.submit(_run_job, job) for job in todo]):
                results.append(fut.result())
                note(results[-1])
    order = {(m.key, s): i for i, (s, m) in enumerate((s, m) for m in methods for s in seeds)}
    return sorted(results, key=lambda r: order[(r.method, r.seed)])


# ------------------------------------------------------------------------------------------ the loopback swarm
def run_swarm(method: Method, setup: Setup, seed: int, out_dir: Path, timeout: float = 420.0,
              log=print) -> RunResult:
    """The method as ``setup.replicas`` real peer processes on 127.0.0.1 (steps schedule, same settings)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import Proc  # noqa: E402 (tests/helpers.py: processes in their own sessions)

    from peer.run import checkpoint

    if len(set(method.tau)) != 1 or method.dp:
        raise ValueError("the swarm run takes one tau for all peers and an outer method")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    res = RunResult(method.key + "@swarm", seed)
    t0 = time.perf_counter()
    started: list = []
    tau = method.tau_of(0, setup.H)
    try:
        boot = Proc.start([sys.executable, "-m", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                           "--identity-path", out_dir / "boot.id"], log_path=out_dir / "boot.log", cwd=REPO)
        started.append(boot)
        initial = boot.wait_for_line(r"^--initial-peers (.+)$", timeout=90).group(1).split()
        peers = []
        for m in range(setup.replicas):
            run_dir = out_dir / f"p{m}"
            cmd = [sys.executable, "-m", "peer", "run", "--config", REPO / "configs/demo.toml",
                   "--initial-peers", *initial, "--run-dir", run_dir, "--log-json", run_dir / "events.jsonl",
                   "--max-steps", setup.steps, "--min-peers", setup.replicas, "--start-timeout", 120,
                   "--model-preset", setup.preset, "--model-factory", setup.factory,
                   "--model-seq-len", setup.seq_len, "--model-init-seed", seed,
                   "--data-source", "synthetic", "--data-vocab-size", setup.vocab_size,
                   "--data-seed", setup.data_seed, "--data-shard", SHARD_STRIDE * seed + m,
                   "--data-batch-size", setup.batch_size, "--inner-threads", 1, "--inner-device", "cpu",
                   "--inner-lr", setup.inner_lr, "--inner-warmup-steps", setup.warmup_steps,
                   "--inner-total-steps", setup.steps, "--inner-weight-decay", 0.1, "--inner-beta1", 0.9,
                   "--inner-beta2", 0.95, "--inner-min-lr-ratio", 0.1, "--inner-grad-clip", 1.0,
                   "--inner-z-loss", 1e-4, "--outer-lr", method.outer_lr, "--outer-momentum", method.outer_momentum,
                   "--outer-sync-every", setup.H, "--outer-schedule", "steps",
                   "--outer-fragment-blocks", method.blocks_per_fragment(setup),
                   "--outer-fragment-pattern", method.pattern,
                   "--outer-codec", method.codec,
                   "--outer-error-feedback" if method.error_feedback else "--no-outer-error-feedback",
                   "--outer-alpha", method.alpha, "--outer-tau", tau,
                   "--outer-eager" if method.eager else "--no-outer-eager", "--outer-merge", method.merge,
                   "--outer-wait-timeout", 100, "--log-every", 1, "--status-interval", 0,
                   "--matchmaking-time", 5, "--matchmaking-timeout", 30, "--request-timeout", 3,
                   "--allreduce-timeout", 60, "--part-timeout", 30, "--progress-period", 2, "--progress-ttl", 15]
            peers.append(Proc.start(cmd, log_path=out_dir / f"p{m}.log", cwd=REPO))
            started.append(peers[-1])
        deadline = time.monotonic() + timeout
        while any(p.returncode is None for p in peers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"swarm peers still running after {timeout:g} s; logs in {out_dir}")
            time.sleep(0.2)
        boot.terminate(timeout=30)
        bad = [(i, p.returncode) for i, p in enumerate(peers) if p.returncode != 0]
        if bad:
            raise RuntimeError(f"swarm peers exited with {bad}; logs in {out_dir}")
    finally:
        for proc in started:
            if proc.returncode is None or proc.session_pids():
                proc.kill_group(signal.SIGKILL)
    held_out = eval_batch(setup)
    finals, curve, train, byts, statuses = [], [], [], [], {}
    for m in range(setup.replicas):
        ev = [json.loads(line) for line in (out_dir / f"p{m}" / "events.jsonl").read_text().splitlines()
              if line.endswith("}")]
        train.append({e["step"]: e["ce"] for e in ev if e["event"] == "step"})
        rounds = [e for e in ev if e["event"] == "round"]
        for e in rounds:
            statuses[e["status"]] = statuses.get(e["status"], 0) + 1
        byts.append(sum(e["bytes_sent"] for e in rounds))
        found = checkpoint.load_latest(out_dir / f"p{m}" / "checkpoints")
        if found is None or found[1]["step"] != setup.steps:
            raise RuntimeError(f"peer {m}: no final checkpoint at step {setup.steps} in {out_dir}")
        model, _ = setup.build(seed)
        model.load_state_dict(found[1]["model"])
        finals.append(evaluate(model, held_out))
        curve.append(evaluate(model, held_out[:setup.curve_seqs]))
        res.finite = res.finite and params_finite(model)
    res.final, res.final_replica0 = sum(finals) / len(finals), finals[0]
    res.bytes_per_peer = sum(byts) / len(byts)
    res.rounds = sum(statuses.values()) // setup.replicas
    res.error = f"round statuses (all peers): {statuses}"
    ends = setup.eval_points
    for end, start in zip(ends, [0] + ends):  # the simulator's windows (train_ce of its eval points)
        window = [t[s] for t in train for s in range(start + 1, end + 1) if s in t]
        res.steps.append(end)
        res.train_ce.append(sum(window) / len(window) if window else math.nan)
    res.eval_ce = [math.nan] * (len(ends) - 1) + [sum(curve) / len(curve)]
    res.seconds = time.perf_counter() - t0
    log(f"  swarm {method.key} seed {seed}: eval CE {res.final:.4f} ({res.seconds:.0f} s wall, {statuses})")
    return res


# ------------------------------------------------------------------------------------------ report
def summarize(results: Sequence[RunResult], floor: float, reference: str = "diloco") -> list[dict]:
    """One row per method: per-seed final eval CE, mean, spread, gap to the floor, paired diff to the reference."""
    by_method: dict[str, dict[int, RunResult]] = {}
    for r in results:
        by_method.setdefault(r.method, {})[r.seed] = r
    ref = by_method.get(reference, {})
    rows = []
    for key, runs in by_method.items():
        seeds = sorted(runs)
        finals = [runs[s].final for s in seeds]
        mean = statistics.fmean(finals)
        paired = [100.0 * (runs[s].final - ref[s].final) / ref[s].final for s in seeds if s in ref]
        base = key.split("@")[0]
        rows.append(dict(
            key=key, item=BY_KEY[base].item if base in BY_KEY else "", label=BY_KEY[base].label if base in BY_KEY
            else key, seeds=seeds, finals=finals, mean=mean, spread=max(finals) - min(finals), gap=mean - floor,
            rel=statistics.fmean(paired) if paired else math.nan, rel_per_seed=paired,
            shared=statistics.fmean(runs[s].final_shared for s in seeds),
            mb_per_peer=statistics.fmean(runs[s].bytes_per_peer for s in seeds) / 1e6,
            finite=all(runs[s].finite for s in seeds), seconds=sum(runs[s].seconds for s in seeds)))
    return rows


def format_table(rows: Sequence[dict], floor: float, swarm_note: str = "") -> str:
    lines = [f"entropy floor {floor:.4f} nats/token; eval CE = mean over replicas on the held-out shard; "
             "rel. diff = paired by seed vs DiLoCo fp32; shared = the shared parameters G (mean over seeds)"
             + swarm_note,
             "", "| # | method | eval CE per seed | mean | spread | gap to floor | rel. diff vs DiLoCo (per seed) "
             "| shared | MB per peer | finite |", "|---|---|---|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        per_seed = " / ".join(f"{x:.4f}" for x in r["finals"])
        rel = "—" if r["key"] == "diloco" or math.isnan(r["rel"]) else \
            f"{r['rel']:+.2f}% ({' / '.join(f'{x:+.2f}' for x in r['rel_per_seed'])})"
        lines.append(f"| {r['item']} | {r['label']}{' (swarm)' if '@swarm' in r['key'] else ''} | {per_seed} | "
                     f"{r['mean']:.4f} | {r['spread']:.4f} | {r['gap']:.4f} | {rel} | "
                     f"{'—' if math.isnan(r['shared']) else format(r['shared'], '.4f')} | {r['mb_per_peer']:.1f} | "
                     f"{'yes' if r['finite'] else 'NO'} |")
    return "\n".join(lines)


# line styles of the plot: (color, linestyle, linewidth)
STYLES = {
    "dp": ("black", "-", 2.4), "diloco": ("dimgray", "--", 2.0), "streaming": ("tab:blue", "-", 1.5),
    "fp4": ("tab:orange", "-", 1.5), "fp4_ef": ("tab:green", "-.", 1.5), "sequential": ("tab:purple", ":", 1.8),
    "tau1_alpha": ("tab:cyan", "-.", 1.4), "tau5_alpha": ("tab:blue", "-.", 1.4),
    "tau1_replay": ("yellowgreen", "-", 1.4), "tau5_replay": ("tab:green", "-", 1.4), "full": ("tab:red", "-", 2.0),
    "tauH_eager": ("tab:purple", "-", 1.6), "tauH_eager_lr": ("tab:purple", "--", 1.6),
    "tauH_naive": ("tab:brown", "-", 1.6), "tauH_naive_lr": ("tab:brown", "--", 1.6),
    "hetero_tau": ("tab:orange", "-", 1.6), "tau5_alpha0": ("tab:gray", "-.", 1.4),
    "full_alpha0": ("tab:pink", "-", 1.6),
}


def plot(results: Sequence[RunResult], floor: float, path: Path, title: str = "") -> bool:
    """Held-out CE minus the entropy floor (log scale) per method: mean over seeds, band = min..max over seeds.
    Returns False (after one line telling how to get it) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return False
    by_method: dict[str, list[RunResult]] = {}
    for r in results:
        if "@swarm" not in r.method:
            by_method.setdefault(r.method, []).append(r)
    swarm = [r for r in results if "@swarm" in r.method]
    panels = [("items 1-4, 7: outer algorithm, wire codec, fragment pattern",
               ["dp", "diloco", "streaming", "fp4", "fp4_ef", "sequential"]),
              ("items 5, 6, 8: overlap, eager, heterogeneous tau (all FP4, P=2)",
               ["dp", "diloco", "tau1_alpha", "tau5_alpha", "tau1_replay", "tau5_replay", "full", "tauH_eager",
                "tauH_eager_lr", "tauH_naive", "tauH_naive_lr", "hetero_tau", "tau5_alpha0", "full_alpha0"])]
    fig, axes = plt.subplots(1, 2, figsize=(15, 8), sharey=True)
    for ax, (name, keys) in zip(axes, panels):
        for key in keys:
            runs = by_method.get(key)
            if not runs:
                continue
            steps = runs[0].steps
            curves = [[c - floor for c in r.eval_ce] for r in runs if r.steps == steps]
            mean = [statistics.fmean(c[i] for c in curves) for i in range(len(steps))]
            lo = [min(c[i] for c in curves) for i in range(len(steps))]
            hi = [max(c[i] for c in curves) for i in range(len(steps))]
            color, ls, lw = STYLES.get(key, ("gray", "-", 1.2))
            ax.plot(steps, mean, color=color, ls=ls, lw=lw, label=f"{BY_KEY[key].item}. {BY_KEY[key].label}")
            ax.fill_between(steps, lo, hi, color=color, alpha=0.18, lw=0)
        for r in swarm:
            base = r.method.split("@")[0]
            if base in keys:
                ax.plot([r.steps[-1]], [r.eval_ce[-1] - floor], marker="*", ms=15, ls="", color=STYLES[base][0],
                        markeredgecolor="black", label=f"{BY_KEY[base].label}: loopback swarm, seed {r.seed}")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("inner steps per peer (eval every H steps, in phase with the last step)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    axes[0].set_ylabel(f"held-out CE - entropy floor {floor:.3f} (nats/token, log scale)")
    fig.suptitle(title, fontsize=9.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path} (matplotlib {matplotlib.__version__})")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="H 16, 6 rounds (102 steps), no swarm unless --swarm: about half of the default")
    ap.add_argument("--methods", default="", help=f"comma-separated subset of: {','.join(BY_KEY)}")
    ap.add_argument("--extra", action="store_true", help=f"add {', '.join(m.key for m in EXTRA)} to the methods")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per method (0..N-1)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=64, help="of the synthetic corpus (and the model)")
    ap.add_argument("--fragment-blocks", type=int, default=3, help="k of the streaming methods (P = L / k)")
    ap.add_argument("--sync-every", type=int, default=None, help="H (default 20, --quick 16)")
    ap.add_argument("--rounds", type=int, default=None, help="steps = rounds * H + 6 (default 8, --quick 6)")
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--jobs", type=int, default=2, help="simulator runs in parallel processes (1 torch thread each)")
    ap.add_argument("--swarm", action=argparse.BooleanOptionalAction, default=None,
                    help="also run the full method as a real loopback swarm (default: on, off with --quick)")
    ap.add_argument("--text", type=Path, default=None, help="a prepared corpus (swarm-peer prepare-data) instead of "
                    "the synthetic one; its vocabulary is the model's")
    ap.add_argument("--stdlib-text", type=Path, default=None, help="prepare Python's standard library sources into "
                    "this directory (BPE of --vocab-size) if not there yet, and train on them (as --text)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "runs/bench_quality")
    ap.add_argument("--plot", type=Path, default=REPO / "docs/quality.png")
    ap.add_argument("--replot", type=Path, help="only print the table and draw the plot of a results.json")
    args = ap.parse_args(argv)

    if args.replot:
        saved = json.loads(args.replot.read_text())
        results = [RunResult(**r) for r in saved["results"]]
        report(results, saved["floor"], saved["title"], args.plot)
        return 0

    text = prepare_stdlib_text(args.stdlib_text, args.vocab_size) if args.stdlib_text else args.text
    vocab = args.vocab_size
    if text:
        from peer.local.manifest import read_manifest
        vocab = int(read_manifest(str(text))[1]["vocab_size"])
    setup = Setup(replicas=args.replicas, preset=args.preset, seq_len=args.seq_len, batch_size=args.batch_size,
                  H=args.sync_every or (16 if args.quick else 20), rounds=args.rounds or (6 if args.quick else 8),
                  inner_lr=args.inner_lr, vocab_size=vocab, fragment_blocks=args.fragment_blocks,
                  text=str(text or ""))
    swarm = args.swarm if args.swarm is not None else not args.quick and not text
    if swarm and text:
        ap.error("--swarm trains on the synthetic corpus only; drop --text/--stdlib-text or pass --no-swarm")
    methods = [BY_KEY[k] for k in args.methods.split(",")] if args.methods else list(METHODS)
    methods += [m for m in EXTRA if args.extra and m not in methods]
    floor = 0.0 if text else MarkovSource(setup.vocab_size, setup.data_seed, 0).entropy_floor  # (text: unknown)
    model, blocks = setup.build(0)
    nparams, P = count_parameters(model), len(partition(model, blocks, setup.fragment_blocks))
    title = (f"{setup.preset} ({nparams:,} params, P={P}), {'text ' + Path(text).name if text else 'synthetic'} "
             f"vocab {setup.vocab_size}, M={setup.replicas} replicas, "
             f"seq {setup.seq_len} x batch {setup.batch_size}, H={setup.H}, {setup.steps} steps "
             f"({setup.steps * setup.seq_len * setup.batch_size:,} tokens per peer), inner AdamW lr "
             f"{setup.inner_lr:g}, outer Nesterov 0.7/0.9 (unless the method says), {args.seeds} seeds")
    print(title)
    print(f"{len(methods)} methods x {args.seeds} seeds in the simulator, {args.jobs} job(s); "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}")
    t0 = time.perf_counter()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def save(results: Sequence[RunResult], **extra) -> None:  # after every run: a crash keeps what is done
        (args.out_dir / "results.json").write_text(json.dumps(dict(
            title=title, floor=floor, setup=dataclasses.asdict(setup), **extra,
            results=[dataclasses.asdict(r) for r in results]), indent=1))

    results = run_all(methods, setup, range(args.seeds), jobs=args.jobs, on_result=save)
    sim_seconds, ok = time.perf_counter() - t0, True
    if swarm:
        print("loopback swarm, full method, seed 0:")
        try:
            results.append(run_swarm(BY_KEY["full"], setup, 0, args.out_dir / "swarm"))
        except (RuntimeError, TimeoutError) as e:
            print(f"  swarm run FAILED: {e}")
            ok = False
    total = time.perf_counter() - t0
    save(results, sim_seconds=sim_seconds, total_seconds=total)
    report(results, floor, title, args.plot)
    print(f"\nsimulator {sim_seconds:.0f} s, total {total:.0f} s wall; results in {args.out_dir / 'results.json'}")
    return 0 if ok and all(r.finite for r in results) else 1


def report(results: Sequence[RunResult], floor: float, title: str, plot_path: Path) -> None:
    rows = summarize(results, floor)
    swarm = [r for r in results if "@swarm" in r.method]
    note = "".join(f"; swarm {r.method}: {r.error}" for r in swarm)
    print()
    print(format_table(rows, floor, note))
    for r in swarm:  # the swarm ran a simulated method's seed: how far apart are they?
        sim = next((x for x in results if x.method == r.method.split("@")[0] and x.seed == r.seed), None)
        if sim is not None:
            diffs = [abs(a - b) for a, b in zip(r.train_ce, sim.train_ce[1:]) if math.isfinite(a) and math.isfinite(b)]
            print(f"\nswarm vs simulator, {sim.method} seed {r.seed}: final eval CE {r.final:.6f} vs {sim.final:.6f} "
                  f"(diff {r.final - sim.final:+.2e}); train CE per window: max |diff| "
                  f"{max(diffs) if diffs else math.nan:.2e} over {len(diffs)} windows; "
                  f"sent per peer {r.bytes_per_peer / 1e6:.2f} MB measured vs {sim.bytes_per_peer / 1e6:.2f} MB "
                  "counted")
    spreads = [r["spread"] for r in rows if len(r["finals"]) > 1]
    if spreads:
        print(f"\nnoise band: seed spread (max - min) median {statistics.median(spreads):.4f}, "
              f"max {max(spreads):.4f} nats")
    plot(results, floor, plot_path, title)


if __name__ == "__main__":
    sys.exit(main())
