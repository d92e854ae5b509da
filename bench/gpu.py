"""Everything that needs a GPU, in one run (``make bench-gpu``); ``--device cpu`` runs the same comparison here.

    .venv/bin/python bench/gpu.py                          # CUDA: 100M, 200M, 500M, 1B; codec; CUDA tests
    .venv/bin/python bench/gpu.py --device cpu --presets tiny,small --steps 120   # the CPU comparison

1. **Step overhead.** A plain PyTorch loop (autocast bf16 on CUDA, fused AdamW on CUDA, grad clip; no host
   synchronization) against the peer's step: :class:`peer.local.inner.InnerLoop` plus the
   :class:`peer.outer.engine.StreamingEngine` launching and applying every fragment's rounds (the full method:
   fragments of 3 blocks, FP4 e3m0, overlap ``--tau``, eager updates) through an echo transport whose rounds run the
   wire codec's encode and decode on a worker thread, in the swarm's pieces, as the swarm's event loop does (the
   network itself is not in it: bench/utilization.py measures links). Same model, batch, precision and device; the
   two loops alternate in ``--blocks`` blocks of ``--steps`` steps, so drift in clocks or thermals hits both. Prints
   the mean wall time per step of each over all blocks (syncs included), the overhead ratio (goal: peer <= 1.02 x
   plain), tokens/s, on CUDA the model FLOPs utilization (6 N tokens/s + attention, against the device's dense bf16
   peak where known), and the training thread's time in each launch and each apply that had work (median and max;
   goal < 5 ms). Both loops use ``--micro-batch`` and ``--activation-checkpointing``.
2. **Memory.** Per preset and loop, in a child process of its own that runs that loop alone (H + tau + 2 steps:
   every fragment launched and applied): peak VRAM (``torch.cuda.max_memory_allocated``) and peak host RSS
   (VmHWM); beside them, what the model, AdamW and the outer state take by their sizes.
3. **Codec.** bench/codec.py on the device: FP4 e3m0 encode and decode throughput against the device's copy
   bandwidth (goal >= 50%).
4. **CUDA tests.** ``pytest -q -rs tests -k cuda`` (skipped without a device).

Writes ``--out`` (JSON) beside the printed tables.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import dataclasses
import datetime
import json
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peer.local import memory  # noqa: E402
from peer.local.markov import MarkovSource  # noqa: E402
from peer.local.inner import InnerLoop, lr_at, split_decay_params  # noqa: E402
from peer.local.model import PRESETS, build_model, count_parameters, lm_loss  # noqa: E402
from peer.config.network import SwarmConfig  # noqa: E402
from peer.net.round.reduction import decode_piece, encode_pieces  # noqa: E402
from peer.outer import host_memory  # noqa: E402
from peer.outer.codec import get_codec  # noqa: E402
from peer.outer.engine import StreamingEngine  # noqa: E402
from peer.outer.settings import OuterSettings  # noqa: E402
from peer.outer.fragments import partition  # noqa: E402
from peer.outer.schedule import rolling_copies  # noqa: E402
from peer.outer.rounds import RoundOutcome, RoundStatus, Span  # noqa: E402
from peer.util import host_peak_bytes  # noqa: E402
from step_clock import StepClock, allocator_counts, counts_between, idle_gaps, profile_table, summary  # noqa: E402

# Dense bf16 peak (FLOP/s) by device name, for MFU; unknown devices print tokens/s only.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12, "3090": 71e12}
INNER = dict(lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=10, total_steps=10_000, min_lr_ratio=0.1,
             grad_clip=1.0, z_loss=1e-4)


class EchoTransport:
    """Every round comes back as a complete group of two identical peers would return it: our Delta through the
    wire codec on a worker thread, in the swarm's streamed pieces of ``swarm.chunk_bytes`` (encoded as a member
    encodes its parts, each decoded into the average as it would arrive). One message for a whole fragment would
    hold the GIL for tens of milliseconds at 1B (its bytes copied into the message twice), stalling the training
    thread's autograd in a way the swarm never does (docs/benchmarks.md, 2026-11-30)."""

    def __init__(self, codec: str, chunk_bytes: int = SwarmConfig().chunk_bytes):
        self.codec = get_codec(codec)
        self.chunk_elems = max(1, chunk_bytes // 4)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="echo-allreduce")

    def _round(self, fragment: int, round_: int, delta: torch.Tensor, weight: float) -> RoundOutcome:
        average = host_memory.empty(delta.numel(), touch=False)
        filled = 0
        for offset, piece in encode_pieces(self.codec, delta, self.chunk_elems):
            filled += decode_piece(self.codec, piece, offset, filled, average)
        return RoundOutcome(fragment, round_, RoundStatus.OK, group_size=2, spans=[Span(0, delta.numel(), average)],
                            total_weight=2 * weight)

    def launch(self, *, fragment, round_, delta, weight, step, expected_round, base=None):
        # (no copy of Delta: the engine keeps it until the round is answered, and the swarm's transport makes none)
        return self.pool.submit(self._round, fragment, round_, delta, weight)


def flops_per_token(model, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (weights, forward + backward) + 12 L d T (attention scores and values)."""
    return 6 * count_parameters(model) + 12 * n_layers * d_model * seq_len


def plain_step_fn(model, device: torch.device, clip: float, compile: bool = False, micro_batch: int = 0,
                  optimizer: str = "adamw"):
    """A plain PyTorch training step of the same model: what a peer's step is compared with. ``micro_batch``: the
    batch in chunks of that many rows, each loss scaled by its share of the rows (the peer's accumulation);
    ``optimizer``: the peer's (adamw, or torchao's adamw8bit)."""
    forward = torch.compile(model) if compile else model
    decay, no_decay = split_decay_params(model)
    groups = [{"params": decay, "weight_decay": INNER["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    if optimizer == "adamw8bit":
        from torchao.optim import AdamW8bit

        opt: torch.optim.Optimizer = AdamW8bit(groups, lr=INNER["lr"], betas=INNER["betas"])
    else:
        fused = {"fused": True} if device.type == "cuda" else {}
        opt = torch.optim.AdamW(groups, lr=INNER["lr"], betas=INNER["betas"], **fused)
    params = decay + no_decay
    step_count = [0]

    def step(batch: torch.Tensor) -> None:
        batch = batch.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        for chunk in batch.split(micro_batch or batch.shape[0]):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = forward(chunk[:, :-1])
            loss, _ = lm_loss(logits, chunk[:, 1:], INNER["z_loss"])
            (loss * (chunk.shape[0] / batch.shape[0])).backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        lr = lr_at(step_count[0], lr=INNER["lr"], warmup_steps=INNER["warmup_steps"],
                   total_steps=INNER["total_steps"], min_lr_ratio=INNER["min_lr_ratio"])
        for group in opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # (torchao's)
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        opt.step()
        step_count[0] += 1
    return step


def pinned_bytes(device: torch.device) -> Optional[dict]:
    """torch's pinned host allocator's byte counters (it rounds each block up to a power of two), on CUDA."""
    if device.type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    return {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_preset(args) -> dict:
    """Runs section 1 and the memory measures of section 2 for ``args.one`` (in a child process)."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, blocks = build_model(args.one, args.vocab, args.seq_len,
                                activation_checkpointing=args.activation_checkpointing)
    model.to(device)
    shape = PRESETS[args.one]
    n = count_parameters(model)
    source = MarkovSource(args.vocab, seed=1)
    batches = [source.next_batch(args.batch, args.seq_len) for _ in range(8)]
    # a memory child builds only the loop it measures (another loop's optimizer or outer state would count)
    plain = plain_step_fn(model, device, INNER["grad_clip"], args.compile, args.micro_batch, args.optimizer) \
        if args.loop != "peer" else None
    if args.loop == "plain":
        assert plain is not None
        for i in range(args.sync_every + args.tau + 5):
            plain(batches[i % len(batches)])
        sync(device)
        return {"preset": args.one, "loop": args.loop, "host_peak_rss_bytes": host_peak_bytes(),
                "peak_vram_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    inner = InnerLoop(model, device=device, micro_batch=args.micro_batch, compile=args.compile,
                      optimizer=args.optimizer, **INNER)
    fragments = partition(model, blocks, 3, "strided")
    settings = OuterSettings(H=args.sync_every, tau=args.tau, eager=True)
    # as the trainer does: each applied state's digest is taken once, at its outcome, and read at the next launch
    digests: dict[int, str] = {}
    on_device = {"auto": None, "on": True, "rolling": "rolling", "off": False}[args.state_on_device]
    engine = StreamingEngine(fragments, settings, EchoTransport(args.codec), state_on_device=on_device,
                             error_feedback_codec=get_codec(args.codec) if args.codec.startswith("topk") else None,
                             on_outcome=lambda frag, st, outcome, step: digests.__setitem__(frag.index, st.digest()),
                             digest_of=lambda p: digests[p])
    digests.update({p: st.digest() for p, st in enumerate(engine.states)})  # (the trainer's start publishes them)
    peer_step = [0]
    profiler = cProfile.Profile() if args.profile_applies else None  # (of the timed applies: where their time goes)
    # the training thread's time in each launch and apply that had work (seconds), while `timed` is set
    blocked: dict[str, list[float]] = {"launch": [], "apply": []}
    timed = [False]
    label = [""]  # what the peer's last step did besides training (the step clock's label)

    def peer(batch):
        with torch.profiler.record_function("inner.step"):  # (ranges for --profile-steps' tables)
            inner.step(batch)
        peer_step[0] += 1
        step = peer_step[0]
        launching = any(engine.schedule.due(step, p) is not None for p in range(len(fragments)))
        t0 = time.perf_counter()
        with torch.profiler.record_function("launch_due"):
            engine.launch_due(step)
        t1 = time.perf_counter()
        applying = any(q and q[0].launch_step + q[0].tau <= step for q in engine.pending)
        if profiler is not None and timed[0] and applying:
            profiler.enable()
        with torch.profiler.record_function("apply_due"):
            engine.apply_due(step)
        if profiler is not None:
            profiler.disable()
        t2 = time.perf_counter()
        label[0] = " ".join(name for name, busy in (("launch", launching), ("apply", applying)) if busy)
        if timed[0]:
            for name, busy, seconds in (("launch", launching, t1 - t0), ("apply", applying, t2 - t1)):
                if busy:
                    blocked[name].append(seconds)

    # warm-up: allocator, kernels, autotuning; the peer's runs a whole cycle of rounds (every fragment launched
    # and applied once: its host buffers and the caching allocators hold what a round needs), outside the timing
    for fn, n_steps in ((plain, 3), (peer, 3 + args.sync_every + args.tau + 2)):
        if fn is not None:
            for i in range(n_steps):
                fn(batches[i % len(batches)])
    sync(device)
    if args.loop != "both":  # the peer's memory alone (the plain loop's above): every fragment's round ran
        engine.close()
        return {"preset": args.one, "loop": args.loop, "host_peak_rss_bytes": host_peak_bytes(),
                "peak_vram_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                "pinned": pinned_bytes(device)}
    timed[0] = True
    waited = (engine.waits.blocked_seconds, engine.waits.worker_wait_seconds)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times: dict[str, list[float]] = {"plain": [], "peer": []}
    clock = StepClock(device)
    per_step: dict[str, list] = {"plain": [], "peer": []}  # each step's length on the device, its lead
    allocator: dict[str, dict[str, int]] = {"plain": {}, "peer": {}}  # synchronizing allocator calls in the blocks
    steps = 0
    for _ in range(args.blocks):
        for name, fn in (("plain", plain), ("peer", peer)):
            sync(device)
            before = allocator_counts(device)
            clock.start()
            t0 = time.perf_counter()
            for i in range(args.steps):
                fn(batches[i % len(batches)])
                clock.mark(label[0] if name == "peer" else "")
            sync(device)
            times[name].append((time.perf_counter() - t0) / args.steps)
            per_step[name] += clock.steps()
            for k, v in counts_between(before, allocator_counts(device)).items():
                allocator[name][k] = allocator[name].get(k, 0) + v
        steps += args.steps
    timeline = summary(per_step["plain"], per_step["peer"])
    profiles = ""
    if args.profile_steps:  # after the timing: the profiler's own cost stays out of it
        for i in range(args.sync_every):  # the peer's window starts at a launch, so that it holds a whole round
            if any(engine.schedule.due(peer_step[0] + 1, p) is not None for p in range(len(fragments))):
                break
            peer(batches[i % len(batches)])
        for name, fn in (("plain", plain), ("peer", peer)):
            trace = f"{args.trace_dir}/{args.one}-{name}-trace.json.gz" if args.trace_dir else ""
            profiles += f"\n{args.one} {name}, {args.profile_steps} steps profiled:\n" + profile_table(
                lambda i, fn=fn: fn(batches[i % len(batches)]), args.profile_steps, device, trace=trace)
            if trace and device.type == "cuda":
                profiles += "\n" + idle_gaps(trace)
    inner.check_finite()
    engine.close()
    if profiler is not None:
        with open(args.profile_applies, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(30)
    rounds = sum(len(st.applied_rounds) for st in engine.states)
    residency = engine.device_state
    copies = rolling_copies(args.tau, args.sync_every, len(fragments))  # (what a rolling residency holds at most)
    mean_step = {k: sum(v) / len(v) for k, v in times.items()}
    tokens = args.batch * args.seq_len
    fpt = flops_per_token(model, shape.n_layers, shape.d_model, args.seq_len)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None) if device.type == "cuda" else None
    tflops = {k: fpt * tokens / t / 1e12 for k, t in mean_step.items()}
    outer_copies = sum(1 for t in ("G", "v", "E", "u") if getattr(engine.states[0], t) is not None)
    return {
        "preset": args.one, "params": n, "compile": args.compile,
        "batch": args.batch, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "device": name, "steps_per_loop": steps, "rounds_applied": rounds,
        "plain_s_per_step": mean_step["plain"], "peer_s_per_step": mean_step["peer"],
        "overhead": mean_step["peer"] / mean_step["plain"], "blocks": times,
        "tokens_per_s": {k: tokens / t for k, t in mean_step.items()}, "tflops": tflops,
        "timeline": timeline, "allocator_calls": allocator, "profiles": profiles,
        "mfu": {k: v * 1e12 / peak for k, v in tflops.items()} if peak else None,
        "peak_vram_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "host_peak_rss_bytes": host_peak_bytes(),
        "blocked_s": {k: {"count": len(v), "median": statistics.median(v) if v else None, "max": max(v, default=None)}
                      for k, v in blocked.items()},
        # of the applies' time: waiting for the transport's aggregate, and for the worker's prepared state
        "launch_s": blocked["launch"], "apply_s": blocked["apply"],
        "waited_s": {"transport": engine.waits.blocked_seconds - waited[0],
                     "worker": engine.waits.worker_wait_seconds - waited[1]},
        "outer_on_device": residency is not None and ("rolling" if residency.rolling else True),
        "rolling_copies": copies,
        "bytes_by_size": {"model_fp32": 4 * n, "adamw": 8 * n, "outer_state": 4 * n * outer_copies,
                          "outer_copies": outer_copies,
                          "outer_on_device": 0 if residency is None else memory.outer_state_bytes(memory.Setting(
                              preset=args.one, vocab_size=args.vocab, seq_len=args.seq_len, batch_size=args.batch,
                              state_on_device="rolling" if residency.rolling else True, rolling_copies=copies))},
    }


def codec_section(device: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "codec.py"), "--device", device, "--codecs", "e3m0"],
                          capture_output=True, text=True, timeout=600)
    return done.stdout + done.stderr[-2000:]


def cuda_tests() -> str:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "tests", "-k", "cuda"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    return "\n".join(done.stdout.strip().splitlines()[-6:])


def gib(x) -> str:
    """Bytes as GiB, or MiB below one GiB (the CPU presets)."""
    if x is None:
        return "—"
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.0f} MiB"


def model_against_measured(args, result: dict) -> str:
    """The memory model's peak (peer/local/memory.py) beside the measured one, for each loop."""
    setting = memory.Setting(preset=result["preset"], vocab_size=args.vocab, seq_len=args.seq_len,
                             batch_size=args.batch, micro_batch=args.micro_batch,
                             activation_checkpointing=args.activation_checkpointing, optimizer=args.optimizer)
    cuda = args.device.startswith("cuda")
    measured = result.get("memory") or {}
    parts = []
    for loop, on_device in (("plain", False), ("peer", result.get("outer_on_device") or False)):
        guess = memory.estimate(dataclasses.replace(setting, state_on_device=on_device,
                                                    rolling_copies=result.get("rolling_copies", 3)),
                                memory.CUDA if cuda else memory.CPU).total
        got = (measured.get(loop) or {}).get("peak_vram_bytes") if cuda else None  # (RSS: not tensors alone)
        parts.append(f"{loop} {gib(guess)}" + (f" against {gib(got)} measured ({guess / got - 1:+.1%})" if got else ""))
    return f"memory model, peak {'VRAM' if cuda else 'tensor bytes'}: " + "; ".join(parts)


def lead_ms(lead) -> str:
    return "-" if lead is None else f"{1e3 * lead:.0f}"


def timeline_lines(r: dict) -> str:
    """The step clock's summary (bench/step_clock.py): where the peer's time over the plain loop's went."""
    t = r["timeline"]
    lines = [f"per step on the device: plain median {1e3 * t['plain_median_s']:.1f} ms, peer median "
             f"{1e3 * t['peer_median_s']:.1f} ms; the peer's time over the plain median, by step: "
             + ", ".join(f"{k} {v:+.3f} s" for k, v in t["excess_s_by_kind"].items()),
             "device lead (s, min / median): " + "; ".join(f"{k} {v['min']:.4f} / {v['median']:.4f}"
                                                          for k, v in t["lead_s"].items())
             + f"; peer steps where the device caught up with the host: {t['peer_steps_device_caught_up']}",
             f"synchronizing allocator calls in the timed blocks: {r['allocator_calls']}",
             "slowest peer steps (ms on the device; the device's lead, ms; ms on the host; steps after a launch; "
             "what): " + ", ".join(
                 f"{1e3 * s['seconds']:.1f} ({lead_ms(s['lead'])}; {1e3 * s['host']:.0f}; +{s['after_launch']}"
                 f"{'; ' + s['label'] if s['label'] else ''})" for s in t["slowest"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--presets", default="100M,200M,500M,1B")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=50, help="steps per block of each loop")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--sync-every", type=int, default=50, help="H")
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--codec", default="e3m0", help="the wire codec of the peer's rounds (a topk codec adds error "
                    "feedback, as the config requires)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit"], help="inner.optimizer")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model in both loops (inner.compile)")
    ap.add_argument("--state-on-device", default="auto", choices=["auto", "on", "rolling", "off"],
                    help="outer.state_on_device")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: codec, tests, memory")
    ap.add_argument("--out", default="runs/bench_gpu.json")
    ap.add_argument("--profile-applies", default="", help="write a cProfile of the timed applies to this file")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timing, torch.profiler over this many steps of each loop (printed); the "
                    "peer's from a launch on")
    ap.add_argument("--trace-dir", default="", help="with --profile-steps, each loop's timeline there (gzipped)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: one preset in this process
    ap.add_argument("--loop", default="both", choices=["both", "plain", "peer"], help=argparse.SUPPRESS)  # (--one)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_preset(args)))
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; use --device cpu for the CPU comparison", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"bench/gpu.py {stamp} device {args.device}: batch {args.batch} x seq {args.seq_len}, vocab {args.vocab}, "
          f"H {args.sync_every}, tau {args.tau}, eager, {args.codec}, {args.blocks} blocks x {args.steps} steps "
          f"per loop; "
          f"micro-batch {args.micro_batch or 'none'}, activation checkpointing {args.activation_checkpointing}, "
          f"{args.optimizer}, compile {args.compile}, outer state on the device {args.state_on_device}")
    results = []
    for preset in args.presets.split(","):
        result: dict = {}
        skip = set(filter(None, args.skip.split(",")))
        loops = ("both",) if "memory" in skip else ("both", "plain", "peer")
        for loop in loops:  # the timing (loops alternating), then each loop's memory alone
            child = [sys.executable, __file__, *sys.argv[1:], "--one", preset, "--loop", loop]
            done = subprocess.run(child, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                print(f"{preset} ({loop}): failed: {done.stderr.strip().splitlines()[-1:]}")
                result = {"preset": preset, "error": done.stderr[-3000:]}
                break
            out = json.loads(done.stdout.strip().splitlines()[-1])
            if loop == "both":
                result = out
            else:
                kept = ("host_peak_rss_bytes", "peak_vram_bytes", "pinned")
                result.setdefault("memory", {})[loop] = {k: out.get(k) for k in kept}
        results.append(result)
    print("\n| preset | params | plain s/step | peer s/step | peer / plain | rounds | tokens/s (peer) "
          "| MFU plain / peer | launch ms (median / max) | apply ms (median / max) | peak VRAM plain / peer "
          "| host peak RSS plain / peer | model + AdamW + outer state (by size) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['preset']} | failed |" + " |" * 11)
            continue
        mfu = "—" if not r["mfu"] else f"{r['mfu']['plain']:.1%} / {r['mfu']['peer']:.1%}"
        size = r["bytes_by_size"]
        mem = r.get("memory") or {k: {"peak_vram_bytes": None, "host_peak_rss_bytes": None} for k in ("plain", "peer")}
        ms = {k: "—" if not b["count"] else f"{1e3 * b['median']:.1f} / {1e3 * b['max']:.1f}"
              for k, b in r["blocked_s"].items()}
        print(f"| {r['preset']} | {r['params'] / 1e6:.1f}M | {r['plain_s_per_step']:.4f} | {r['peer_s_per_step']:.4f} "
              f"| {r['overhead']:.3f} | {r['rounds_applied']} | {r['tokens_per_s']['peer']:.0f} | {mfu} "
              f"| {ms['launch']} | {ms['apply']} "
              f"| {gib(mem['plain']['peak_vram_bytes'])} / {gib(mem['peer']['peak_vram_bytes'])} "
              f"| {gib(mem['plain']['host_peak_rss_bytes'])} / {gib(mem['peer']['host_peak_rss_bytes'])} "
              f"| {gib(size['model_fp32'])} + {gib(size['adamw'])} + {gib(size['outer_state'])} "
              f"({size['outer_copies']} copies; {gib(size.get('outer_on_device', 0))} of them on the device too) |")
    for r in results:
        if "error" not in r:
            print(f"{r['preset']}: outer state on the device {r['outer_on_device']}; of the applies, waiting for the "
                  f"transport {r['waited_s']['transport']:.3f} s, for the worker {r['waited_s']['worker']:.3f} s")
            print(f"{r['preset']}: {model_against_measured(args, r)}")
            print(f"{r['preset']}: {timeline_lines(r)}{r['profiles']}")
    skip = set(filter(None, args.skip.split(",")))
    extra = {}
    if "codec" not in skip:
        extra["codec"] = codec_section(args.device.split(":")[0])
        print("\ncodec (bench/codec.py):\n" + extra["codec"])
    if "tests" not in skip:
        extra["cuda_tests"] = cuda_tests()
        print("CUDA tests (pytest -k cuda):\n" + extra["cuda_tests"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": stamp, "args": vars(args), "results": results, **extra}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
