"""``swarm-peer prepare-data INPUT... --out DIR``: text or JSONL files -> the token shards that
``data.source = "tokens"`` reads (the work is in peer/local/prepare.py).

Prints a summary line and the ``[data]`` lines of the config to use; an input to fix exits with status 2 and one
line (``swarm-peer: error: ...``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from peer.local.prepare import DEFAULT_SHARD_TOKENS, DEFAULT_VOCAB_SIZE, PrepareError, prepare

EXIT_SETUP = 2  # as swarm_peer's


def add_parser(sub: Any) -> None:
    """The ``prepare-data`` subcommand, on ``sub`` (the ``add_subparsers`` of ``swarm-peer``)."""
    p = sub.add_parser("prepare-data", help="tokenize text or JSONL files into shards for data.source = tokens",
                       description="Tokenize .txt (UTF-8, one document per file) or .jsonl (one JSON object per "
                       "line) files into token shards, a tokenizer.json and a manifest.json in --out, for "
                       "data.source = \"tokens\". Deterministic: the same inputs and options give the same files, "
                       "so every peer that prepares the same corpus has the same run hash.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt or .jsonl files, read in this order")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="FILE", help="a Hugging Face tokenizer.json to use (it needs an "
                     "end-of-document token such as <|endoftext|> or </s>)")
    tok.add_argument("--vocab-size", type=int, metavar="N", help=f"train a byte-level BPE of N ids on the inputs "
                     f"(default {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--text-field", default="text", metavar="NAME", help="the JSONL field holding a document's text "
                   "(default: text)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--force", action="store_true", help="replace data prepared in --out from other inputs or "
                   "options")
    p.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a "
                   "terminal)")


def run(ns: argparse.Namespace) -> int:
    """Prepares the data ``ns`` names; returns the exit status."""
    try:
        m = prepare(ns.inputs, ns.out, tokenizer=ns.tokenizer, vocab_size=ns.vocab_size, text_field=ns.text_field,
                    shard_tokens=ns.shard_tokens, force=ns.force, progress=not ns.quiet and sys.stderr.isatty())
    except PrepareError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return EXIT_SETUP
    shards = len(m["shards"])
    print(f"prepared {m['total_tokens']:,} tokens in {shards} shard{'s' * (shards != 1)} (vocab {m['vocab_size']}, "
          f"{m['dtype']}) in {ns.out}")
    print("config (every peer of the run prepares the same inputs or copies this directory):")
    print("[data]")
    print('source = "tokens"')
    print(f"paths = [{_toml_string(ns.out)}]")
    print(f"vocab_size = {m['vocab_size']}")
    return 0


def _toml_string(s: str) -> str:
    """``s`` as a TOML basic string (a JSON string is one, for the characters a path holds)."""
    import json

    return json.dumps(s, ensure_ascii=False)
