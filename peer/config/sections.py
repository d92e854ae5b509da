"""The sections of a peer's configuration, one ``kw_only`` dataclass each: every field with its default, its help
(``swarm-peer run --help``) and whether it is local; each section checks its own values as it is built. Here the
model, the data, the inner and outer loops, the run and the owner's limits; the ``swarm`` section, how this peer
meets the others, is :mod:`peer.config.network`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from peer.config.fields import (CODEC_NAMES, COMPILE_CHOICES, INNER_OPTIMIZERS, MAX_MBPS, MIN_MBPS, ConfigError,
                                auto_outer_step, check, parse_active_hours, setting, valid_mbps)


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = setting("tiny", help="Built-in shape: tiny, small, 35M, 100M, 200M, 300M, 500M, 1B (see "
            "peer/local/model.py).")
    factory: str = setting("", help="Optional user model as ``module:factory`` returning ``(model, blocks)``; "
            "overrides preset.")
    hf_config: str = setting("", local=True, help="Optional Hugging Face causal LM: path of a local ``config.json`` "
            "(or its directory); built from the config with fresh weights, never downloaded; overrides preset; needs "
            "the ``hf`` extra. The path is per peer; the run hash covers the file's content.")
    hf_blocks: str = setting("", help="With hf_config: dotted path of the model's block list (e.g. "
            "``model.layers``) when it is not one of model.layers, transformer.h, gpt_neox.layers.")
    activation_checkpointing: bool = setting(False, local=True, help="Recompute each block's activations in the "
            "backward pass instead of storing them: less VRAM, ~1.3x the compute")
    seq_len: int = setting(128, help="Tokens per training sequence.")
    init_seed: int = setting(0, help="Seed of the initial weights; every peer of a run starts from the same "
            "``theta_0``.")

    def __post_init__(self) -> None:
        check(bool(self.preset), "model.preset", "a preset name", self.preset)
        check(self.factory == "" or ":" in self.factory, "model.factory", "'module:callable'", self.factory)
        if self.hf_config and self.factory:
            raise ConfigError("model.hf_config and model.factory are exclusive: set one of them")
        check(not self.hf_blocks or bool(self.hf_config), "model.hf_blocks", "empty unless model.hf_config is set",
               self.hf_blocks)
        check(self.seq_len >= 2, "model.seq_len", ">= 2", self.seq_len)


@dataclass(kw_only=True)
class DataConfig:
    source: str = setting("synthetic", local=True, help="synthetic (seeded Markov corpus, known entropy floor), text "
            "(byte-level files), bin (uint16 shards), tokens (the output of swarm-peer prepare-data; the run hash "
            "covers its manifest).")
    paths: list[str] = setting(factory=list, local=True, help="Input files for text/bin sources; for tokens, one "
            "path: the prepared directory (or its manifest.json).")
    vocab_size: int = setting(256, help="Vocabulary size (256 for byte-level text).")
    batch_size: int = setting(8, local=True, help="Sequences per inner step on this peer (peers may differ: "
            "contributions are weighted by tokens).")
    micro_batch: int = setting(0, local=True, help="Gradient accumulation: sequences per forward/backward pass "
            "(batch_size / micro_batch passes per inner step, the same update; 0 = the whole batch at once). Lower "
            "it when the batch does not fit in GPU memory.")
    seed: int = setting(1234, help="Seed of the synthetic corpus (the same for every peer of a run: they learn one "
            "distribution).")
    shard: int = setting(-1, local=True, help="This peer's data shard; -1 derives it from the peer id, so every peer "
            "reads its own stream.")
    holdout: float = setting(0.01, help="Fraction of a text, bin or tokens corpus held out of training (its last "
            "tokens), on which the shared model is evaluated (run.eval_every); the synthetic corpus holds out a sample "
            "stream of its own.")

    def __post_init__(self) -> None:
        check(self.source in ("synthetic", "text", "bin", "tokens"), "data.source",
               "one of synthetic, text, bin, tokens", self.source)
        check(self.source == "synthetic" or bool(self.paths), "data.paths", "non-empty for text/bin/tokens",
               self.paths)
        check(2 <= self.vocab_size <= 1 << 20, "data.vocab_size", "in [2, 1048576]", self.vocab_size)
        check(self.batch_size >= 1, "data.batch_size", ">= 1", self.batch_size)
        check(0 <= self.micro_batch <= self.batch_size, "data.micro_batch", "in [0, data.batch_size]",
               self.micro_batch)
        check(self.shard >= -1, "data.shard", ">= -1", self.shard)
        check(0.0 <= self.holdout <= 0.5, "data.holdout", "in [0, 0.5]", self.holdout)


@dataclass(kw_only=True)
class InnerConfig:
    lr: float = setting(3e-3, help="Peak AdamW learning rate.")
    weight_decay: float = setting(0.1, help="AdamW decoupled weight decay.")
    beta1: float = setting(0.9, help="AdamW beta1.")
    beta2: float = setting(0.95, help="AdamW beta2.")
    warmup_steps: int = setting(50, help="Linear warm-up steps.")
    total_steps: int = setting(5000, help="Step at which the cosine schedule reaches lr * min_lr_ratio.")
    min_lr_ratio: float = setting(0.1, help="Final LR as a fraction of the peak.")
    grad_clip: float = setting(1.0, help="Global gradient-norm clip (0 disables).")
    z_loss: float = setting(1e-4, help="z-loss coefficient (Chinchilla / Streaming DiLoCo).")
    device: str = setting("auto", local=True, help="auto (cuda if available), cpu, cuda, cuda:N.")
    threads: int = setting(0, local=True, help="torch intra-op CPU threads (0 keeps torch's default).")
    compile: str = setting("auto", local=True, help="Run the model's forward and backward through torch.compile: "
            "auto (on a CUDA card of compute capability 7.0 or newer, with Triton installed), on, or off. Faster "
            "steps on a GPU after a compile at start that can take minutes; on the CPU it needs a C++ compiler. The "
            "weights, checkpoints and fragments are the uncompiled model's.")
    optimizer: str = setting("adamw", local=True, help="adamw, or adamw8bit: torchao's AdamW with 8-bit moments, "
            "6 bytes per parameter less on the device (what fits the 1B preset in 24 GiB: swarm-peer doctor); each "
            "step then waits for the device to check the loss, and the first compiles the optimizer's step.")

    def __post_init__(self) -> None:
        check(self.lr > 0, "inner.lr", "> 0", self.lr)
        check(self.weight_decay >= 0, "inner.weight_decay", ">= 0", self.weight_decay)
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "inner.beta1/beta2", "in [0, 1)", (self.beta1, self.beta2))
        check(self.warmup_steps >= 0, "inner.warmup_steps", ">= 0", self.warmup_steps)
        check(self.total_steps >= 1, "inner.total_steps", ">= 1", self.total_steps)
        check(self.warmup_steps <= self.total_steps, "inner.warmup_steps", "<= inner.total_steps", self.warmup_steps)
        check(0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio", "in [0, 1]", self.min_lr_ratio)
        check(self.grad_clip >= 0, "inner.grad_clip", ">= 0", self.grad_clip)
        check(self.z_loss >= 0, "inner.z_loss", ">= 0", self.z_loss)
        check(self.optimizer in INNER_OPTIMIZERS, "inner.optimizer", " or ".join(INNER_OPTIMIZERS), self.optimizer)
        ok = self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        check(ok, "inner.device", "auto, cpu, cuda or cuda:N", self.device)
        check(self.threads >= 0, "inner.threads", ">= 0", self.threads)
        check(self.compile in COMPILE_CHOICES, "inner.compile", ", ".join(COMPILE_CHOICES), self.compile)


@dataclass(kw_only=True)
class OuterConfig:
    lr: float | str = setting("auto", help="Outer Nesterov learning rate, or auto: DiLoCo's 0.7 with a dense codec, "
            "3.0 with a top-k one (resolved when the config is read).")
    momentum: float | str = setting("auto", help="Outer Nesterov momentum, or auto: DiLoCo's 0.9 with a dense codec, "
            "0.5 with a top-k one (resolved when the config is read).")
    sync_every: int = setting(100, help="H: inner steps between two syncs of the same fragment.")
    fragment_blocks: int = setting(3, help="k: transformer blocks per fragment (P = ceil(L/k) fragments); 0 syncs "
            "the whole model (DiLoCo).")
    fragment_pattern: str = setting("strided", help="How blocks map to fragments: strided (p, p+P, ...; the paper's "
            "default) or sequential.")
    schedule: str = setting("clock", help="When rounds happen: clock (round r of fragment p at swarm time "
            "clock_origin + (r + p/P) * round_seconds; the volunteer default: peers of any speed, nobody waits for a "
            "slower one) or steps (every H local steps, lockstep: homogeneous peers, the paper's schedule; "
            'docs/benchmarks.md "Drop and rejoin" has the evidence).')
    round_seconds: float = setting(60.0, help="Clock schedule: seconds between two rounds of the same fragment.")
    clock_origin: float = setting(0.0, help="Clock schedule: swarm time (unix seconds) at which round 0 of fragment "
            "0 starts.")
    codec: str = setting("e3m0", help="Wire codec of outer gradients: e3m0 (FP4, 4.5 bits/element), fp8, bf16 or "
            "fp32 (ablations); topk32, topk64, topk128 (the k largest of every 4096 elements, 0.13-0.5 bits/element, "
            "for home uplinks; they need outer.error_feedback).")
    error_feedback: bool = setting(False, local=True, help="Carry each round's codec rounding error into the next "
            "round's outer gradient (per fragment).")
    stochastic_rounding: bool = setting(False, local=True, help="Round FP4/FP8 codes stochastically (unbiased) "
            "instead of to nearest.")
    alpha: float = setting(0.0, local=True, help="Merge factor: theta <- alpha*theta + (1-alpha)*G after a round (0 "
            "= take the synced value).")
    tau: int | str = setting(0, local=True, help="Overlap: inner steps this peer trains before it must have a "
            "round's aggregate (0..H), or ``auto``: from this peer's measured round time and step time, at most "
            "tau_max.")
    tau_max: int = setting(10, local=True, help="Upper bound of ``tau = auto``.")
    eager: bool = setting(False, local=True, help="Eager updates: apply our own outer gradient at launch, corrected "
            "when the aggregate arrives.")
    merge: str = setting("alpha", local=True, help="How a late aggregate meets local weights: alpha (Streaming "
            "DiLoCo) or replay (keep the tau steps).")
    wait_timeout: float = setting(180.0, local=True, help="Seconds to wait at launch + tau for an aggregate before "
            "the round counts as missed.")
    state_on_device: str = setting("auto", local=True, help="Keep a copy of the outer state G, v on the training "
            "device, so launches and applies only enqueue work there: on (every fragment's: 8 bytes per parameter "
            "of device memory), rolling (only the fragments in flight and the next to launch), off, or auto (on "
            "with CUDA where the device has twice that room beside the training, else rolling where it has twice "
            "that room, else off; needs tau < sync_every).")
    aggregator: str = setting("clipped", help="How a reducer combines its span's parts: clipped (weights capped, "
            "CenteredClip around the coordinate-wise median: one peer's effect is bounded; for swarms of strangers) "
            "or mean (the plain token-weighted mean: every peer trusted). See peer/outer/aggregate.py.")
    clip_factor: float = setting(1.0, help="clipped: radius = clip_factor x the median distance of the parts to "
            "their coordinate-wise median (>= 1).")
    weight_cap: float = setting(2.0, help="clipped: a peer's declared weight counts at most weight_cap x the "
            "group's lower median (>= 1).")
    length_cap: float = setting(1.25, help="clipped: a peer's part counts at most length_cap x the group's lower "
            "median part length (>= 1).")
    max_weight_cap: float = setting(8.0, help="clipped: both caps rise up to max_weight_cap x where the peer's "
            "progress records vouch for a speed that high relative to the group (>= both).")
    clip_iterations: int = setting(1, help="clipped: CenteredClip steps (1-20).")

    def __post_init__(self) -> None:
        check(self.codec in CODEC_NAMES, "outer.codec", " or ".join(CODEC_NAMES), self.codec)
        # auto becomes its number here, so the run's hash, the engine and the doctor all see the step it stands for
        auto_lr, auto_momentum = auto_outer_step(self.codec)
        self.lr, self.momentum = _resolved(self.lr, auto_lr), _resolved(self.momentum, auto_momentum)
        check(isinstance(self.lr, float) and self.lr > 0, "outer.lr", "auto or a number > 0", self.lr)
        check(isinstance(self.momentum, float) and 0 <= self.momentum < 1, "outer.momentum",
              "auto or a number in [0, 1)", self.momentum)
        check(self.sync_every >= 1, "outer.sync_every", ">= 1", self.sync_every)
        check(self.fragment_blocks >= 0, "outer.fragment_blocks", ">= 0", self.fragment_blocks)
        check(self.fragment_pattern in ("strided", "sequential"), "outer.fragment_pattern", "strided or sequential",
               self.fragment_pattern)
        check(self.schedule in ("steps", "clock"), "outer.schedule", "steps or clock", self.schedule)
        check(self.round_seconds > 0, "outer.round_seconds", "> 0", self.round_seconds)
        check(not self.codec.startswith("topk") or self.error_feedback, "outer.error_feedback",
              f"true with outer.codec = {self.codec} (a sparse codec sends a few percent of each round's outer "
              "gradient; error feedback carries the rest into the next rounds)", self.error_feedback)
        check(self.tau == "auto" or (isinstance(self.tau, int) and 0 <= self.tau <= self.sync_every), "outer.tau",
               "auto or an integer in [0, outer.sync_every]", self.tau)
        check(self.tau_max >= 1, "outer.tau_max", ">= 1 (auto tau is also kept below outer.sync_every)",
               self.tau_max)
        check(self.merge in ("alpha", "replay"), "outer.merge", "alpha or replay", self.merge)
        check(self.wait_timeout > 0, "outer.wait_timeout", "> 0 seconds", self.wait_timeout)
        check(self.state_on_device in ("auto", "on", "rolling", "off"), "outer.state_on_device",
              "auto, on, rolling or off", self.state_on_device)
        check(self.state_on_device in ("auto", "off") or self.tau != self.sync_every,
              "outer.state_on_device", "auto or off with outer.tau = outer.sync_every (its terms live on the host)",
              self.state_on_device)
        check(0 <= self.alpha <= 1, "outer.alpha", "in [0, 1]", self.alpha)
        check(self.aggregator in ("clipped", "mean"), "outer.aggregator", "clipped or mean", self.aggregator)
        check(self.clip_factor >= 1, "outer.clip_factor", ">= 1", self.clip_factor)
        check(self.weight_cap >= 1, "outer.weight_cap", ">= 1", self.weight_cap)
        check(self.length_cap >= 1, "outer.length_cap", ">= 1", self.length_cap)
        check(self.max_weight_cap >= max(self.weight_cap, self.length_cap), "outer.max_weight_cap",
               ">= outer.weight_cap and outer.length_cap", self.max_weight_cap)
        check(1 <= self.clip_iterations <= 20, "outer.clip_iterations", "in [1, 20]", self.clip_iterations)

    @property
    def nesterov(self) -> tuple[float, float]:
        """The outer step's (lr, momentum), ``auto`` resolved for the codec (a valid config holds numbers)."""
        return float(self.lr), float(self.momentum)


def _resolved(value: float | str, auto: float) -> float | str:
    """``auto`` as the number it stands for, an integer as a float; anything else as given (checked after)."""
    if value == "auto":
        return auto
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


@dataclass(kw_only=True)
class RunConfig:
    run_dir: str = setting("runs/peer", local=True, help="Directory for identity, logs and (later) checkpoints.")
    max_steps: int = setting(0, local=True, help="Stop cleanly after this many inner steps (0 = run until stopped).")
    log_json: str = setting("", local=True, help="Path of a JSON-lines event log (step and round events); empty "
            "disables.")
    log_every: int = setting(10, local=True, help="Inner steps between two step events / log lines.")
    eval_every: int = setting(10, local=True, help="Evaluate the shared model (the outer parameters G, not this "
            "peer's weights) on the held-out data after every N applied rounds of fragment 0 (0 = never): loss and "
            "perplexity in the events, the status, the metrics and the monitor.")
    eval_sequences: int = setting(32, local=True, help="Held-out sequences of each evaluation (the same ones every "
            "time, on every peer).")
    status_interval: float = setting(2.0, local=True, help="Seconds between console status lines (0 disables).")
    log_level: str = setting("INFO", local=True, help="Python log level of the console log.")
    checkpoint_minutes: float = setting(10.0, local=True, help="Minutes between checkpoints in RUN_DIR/checkpoints "
            "(0 disables the timer; one is always written at a clean stop).")
    checkpoint_rounds: int = setting(0, local=True, help="Also checkpoint after every N applied rounds of fragment 0 "
            "(0 disables).")
    checkpoint_keep: int = setting(3, local=True, help="Checkpoints kept (the newest ones).")
    checkpoint_background: bool = setting(True, local=True, help="Write checkpoints in a background thread: the "
            "training step only copies the state (one checkpoint's size of host RAM while it is written); false "
            "writes them in the training thread (no copy).")
    control: bool = setting(True, local=True, help="Serve the local control API (RUN_DIR/control.sock, owner only) "
            "for swarm-peer status|pause|resume|finish|limits and the Docker health check.")
    metrics_port: int = setting(0, local=True, help="Serve Prometheus metrics on this port (0 = off; the figures "
            "of swarm-peer status, README 'Metrics').")
    metrics_host: str = setting("127.0.0.1", local=True, help="Address the metrics endpoint listens on (0.0.0.0 "
            "opens it to the network).")

    def __post_init__(self) -> None:
        check(bool(self.run_dir), "run.run_dir", "a directory path", self.run_dir)
        check(self.max_steps >= 0, "run.max_steps", ">= 0", self.max_steps)
        check(self.log_every >= 1, "run.log_every", ">= 1", self.log_every)
        check(self.eval_every >= 0, "run.eval_every", ">= 0 (0 = never)", self.eval_every)
        check(1 <= self.eval_sequences <= 4096, "run.eval_sequences", "in [1, 4096]", self.eval_sequences)
        check(self.status_interval >= 0, "run.status_interval", ">= 0", self.status_interval)
        check(self.checkpoint_minutes >= 0, "run.checkpoint_minutes", ">= 0", self.checkpoint_minutes)
        check(self.checkpoint_rounds >= 0, "run.checkpoint_rounds", ">= 0", self.checkpoint_rounds)
        check(self.checkpoint_keep >= 1, "run.checkpoint_keep", ">= 1", self.checkpoint_keep)
        check(0 <= self.metrics_port <= 65535, "run.metrics_port", "a TCP port in 0..65535 (0 = off)",
               self.metrics_port)
        check(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "run.log_level",
               "DEBUG, INFO, WARNING or ERROR", self.log_level)


@dataclass(kw_only=True)
class LimitsConfig:
    """A volunteer's resource limits (peer/control/limits.py); ``swarm-peer limits`` changes them at run time. The
    CPU threads are ``inner.threads``."""

    duty_cycle: int = setting(100, local=True, help="Percent of wall time spent training (1..100): after each step "
            "the peer rests so that it trains this share of the time, like BOINC's CPU-time limit.")
    active_hours: str = setting("", local=True, help="Daily window HH:MM-HH:MM in local time (may wrap midnight) "
            "in which the peer trains; outside it the peer pauses and stays in the swarm's view. Empty = always.")
    upload_mbps: float = setting(0.0, local=True, help="Cap on what the peer uploads in its all-reduce and "
            "state-transfer streams, in Mbit/s (0 = no cap). A capped peer's rounds take longer: keep "
            "swarm.allreduce_timeout above what one fragment's share takes at the cap (the peer warns).")
    download_mbps: float = setting(0.0, local=True, help="The same for downloads, in Mbit/s (0 = no cap).")
    vram_gb: float = setting(0.0, local=True, help="Cap on the GPU memory the peer's training may take, in GiB "
            "(0 = no cap), set at start (torch's per-process memory fraction): a step that needs more fails with "
            "an out-of-memory error instead of taking the rest of the card. No effect on the CPU.")

    def __post_init__(self) -> None:
        check(1 <= self.duty_cycle <= 100, "limits.duty_cycle", "a percent in 1..100", self.duty_cycle)
        for name in ("upload_mbps", "download_mbps"):
            check(valid_mbps(getattr(self, name)), f"limits.{name}",
                   f"0 (no cap) or Mbit/s in {MIN_MBPS:g}..{MAX_MBPS:g}", getattr(self, name))
        check(math.isfinite(self.vram_gb) and 0 <= self.vram_gb <= 1e5, "limits.vram_gb", "GiB in 0..1e5 (0 = no cap)",
               self.vram_gb)
        try:
            parse_active_hours(self.active_hours)
        except ValueError as e:
            raise ConfigError(f"limits.active_hours: {e}") from None
