"""``swarm-peer export``, ``sample`` and ``eval``: the model a run dir holds, taken home, tried out or measured.

    swarm-peer export --run-dir R --out DIR [--weights shared|local] [--force]
    swarm-peer sample --run-dir R --prompt TEXT [--tokens 200] [--temperature 0.8] [--top-k 50] [--seed 0]
    swarm-peer eval --run-dir R [--data PATH ...] [--sequences 256]

Both read the run dir's newest checkpoint only (no swarm, no config file: the checkpoint holds the resolved
config); they may run while the peer trains. What they write and how it loads: peer/run/export.py.
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = ("export", "sample", "eval")


def add_parsers(sub) -> None:
    """Adds the ``export`` and ``sample`` subcommands to ``swarm-peer``'s subparsers."""
    ex = sub.add_parser("export", help="write the swarm's model as safetensors (or a transformers directory)",
                        description="Write the model of a run dir's newest checkpoint so that it loads without "
                        "swarmloco: safetensors + config.json + modeling.py for built-in presets, a "
                        "save_pretrained directory for Hugging Face models (with the run's tokenizer).")
    ex.add_argument("--out", required=True, help="directory to write (empty or absent; see --force)")
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out")
    sa = sub.add_parser("sample", help="generate text from a run dir's newest checkpoint",
                        description="Generate text with the model of a run dir's newest checkpoint, to see what "
                        "the swarm has learned.")
    sa.add_argument("--prompt", required=True, help="text to continue")
    sa.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    sa.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)")
    sa.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all; default 50)")
    sa.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    sa.add_argument("--tokenizer", default="", help="tokenizer.json to use instead of the run's prepared data's")
    ev = sub.add_parser("eval", help="the held-out loss of a run dir's newest checkpoint",
                        description="Evaluate the model of a run dir's newest checkpoint on held-out data: the "
                        "held-out part (data.holdout) of the run's own data, or of --data read the way the run "
                        "reads its data (the same data.source). Prints the mean cross-entropy and perplexity.")
    ev.add_argument("--data", nargs="+", default=None, help="data paths in place of the run's data.paths")
    ev.add_argument("--sequences", type=int, default=256, help="held-out sequences to evaluate (default 256)")
    for parser in (ex, sa, ev):
        parser.add_argument("--run-dir", required=True, help="the peer's run dir (holds checkpoints/)")
        parser.add_argument("--weights", choices=("shared", "local"), default="shared",
                            help="shared: the swarm's outer parameters G (every peer holds the same); local: this "
                            "peer's own weights, with its inner steps since the last sync (default shared)")


def run(ns: argparse.Namespace) -> int:
    """Runs ``export`` or ``sample``; exit status 2 with one line for anything to fix."""
    from peer.errors import SetupError

    try:
        return {"export": _export, "sample": _sample, "eval": _eval}[ns.command](ns)
    except SetupError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return 2


def _export(ns: argparse.Namespace) -> int:
    from peer.run.export import export, load_run

    saved = load_run(ns.run_dir)
    files = export(saved, ns.out, weights=ns.weights, force=ns.force)
    print(f"exported the {ns.weights} weights of {saved.path.name} (step {saved.step}) to {ns.out}: "
          + ", ".join(p.relative_to(ns.out).as_posix() for p in files))
    return 0


def _sample(ns: argparse.Namespace) -> int:
    from peer.errors import SetupError
    from peer.run.export import generate, load_run, run_model, text_codec

    if ns.tokens < 1 or ns.temperature < 0 or ns.top_k < 0:
        raise SetupError("--tokens must be >= 1, --temperature >= 0 and --top-k >= 0")
    saved = load_run(ns.run_dir)
    codec = text_codec(saved.cfg, ns.tokenizer)
    model = run_model(saved, ns.weights)
    ids = generate(model, codec.encode(ns.prompt), new_tokens=ns.tokens, max_seq_len=saved.cfg.model.seq_len,
                   temperature=ns.temperature, top_k=ns.top_k, seed=ns.seed)
    print(f"({saved.path.name}, step {saved.step}, {ns.weights} weights, tokenizer {codec.name})", file=sys.stderr)
    print(ns.prompt + codec.decode(ids))
    return 0


def _eval(ns: argparse.Namespace) -> int:
    from peer.run.evaluation import evaluate_checkpoint
    from peer.run.export import load_run

    saved = load_run(ns.run_dir)
    e = evaluate_checkpoint(saved, data_paths=ns.data, sequences=ns.sequences, weights=ns.weights)
    print(f"held-out loss {e.loss:.4f} nats, perplexity {e.perplexity:.2f}: {e.sequences} sequences "
          f"of {e.tokens // e.sequences} tokens; {ns.weights} weights of {saved.path.name} (step {saved.step}, "
          f"fragment rounds {e.rounds})")
    return 0
