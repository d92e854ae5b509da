"""Codec throughput beside a plain tensor copy of the same data, in the same run.

    .venv/bin/python bench/codec.py [--numel 16777216] [--device cpu|cuda] [--reps 10] [--codecs e3m0,fp8,bf16,topk32]
                                    [--chunk-bytes N]

For each codec prints encode and decode throughput in GB/s of fp32 data (numel * 4 bytes / seconds), best of
``--reps``, and the ratio to the copy bandwidth measured in the same run (the figure of merit). The copy is
``tensor.clone()`` (a fresh output, like decode's) and, for reference, ``out.copy_(tensor)`` into a
preallocated buffer. Encode and decode include everything the peer pays: validation, the host bytes of the
messages. By default the whole vector is one message (``peer.codec.encode`` / ``decode``); ``--chunk-bytes N``
cuts it as the all-reduce cuts a span (``encode_pieces``; per piece ``decode_piece`` into one output of the
span's size, allocated as the all-reduce allocates it, as the reducer reads a stream).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from peer.config.network import SwarmConfig  # noqa: E402
from peer.net.round.reduction import decode_piece, encode_pieces  # noqa: E402
from peer.outer import host_memory  # noqa: E402
from peer.outer.codec import decode, encode, get_codec  # noqa: E402


def best_of(fn, reps: int, sync) -> float:
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--codecs", default="e3m0,fp8,bf16,topk32,topk64,topk128")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--chunk-bytes", type=int, default=0,
                    help=f"fp32 bytes per message, as the all-reduce cuts a span (its default: "
                         f"{SwarmConfig().chunk_bytes}); 0: one message")
    args = ap.parse_args(argv)

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here; falling back to cpu")
        device = "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    torch.manual_seed(0)
    x = torch.randn(args.numel, device=device)
    gb = args.numel * 4 / 1e9
    dev_name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"numel {args.numel} ({gb * 1e3:.1f} MB fp32), device {dev_name}, torch {torch.__version__}, "
          f"best of {args.reps}")

    out = torch.empty_like(x)
    names = [n for n in args.codecs.split(",") if n]
    chunk = max(1, args.chunk_bytes // 4)
    if args.chunk_bytes:
        if device != "cpu":
            raise SystemExit("--chunk-bytes: the pieces are decoded on the host; pass --chunk-bytes 0 with --device")
        print(f"pieces of up to {chunk} elements ({args.chunk_bytes} fp32 bytes), as the all-reduce sends them")

    def enc(name: str) -> Any:
        return encode_pieces(get_codec(name), x, chunk) if args.chunk_bytes else encode(x, name)

    def dec(msg: Any) -> torch.Tensor:
        if not args.chunk_bytes:
            return decode(msg, device=device)
        codec, out, filled = get_codec(msg[0][1].codec), host_memory.empty(args.numel, touch=False), 0
        for off, piece in msg:  # as the reducer and run_allreduce read a stream
            filled += decode_piece(codec, piece, off, filled, out)
        return out

    msgs = {name: enc(name) for name in names}
    # Round-robin over all measurements, best of --reps each: background load on a shared machine
    # then hits the copy and the codecs alike.
    jobs = {"clone": lambda: x.clone(), "copy_": lambda: out.copy_(x)}
    for name in names:
        jobs[f"{name} encode"] = lambda name=name: enc(name)
        jobs[f"{name} decode"] = lambda name=name: dec(msgs[name])
    best = {k: float("inf") for k in jobs}
    for _ in range(args.reps):
        for k, fn in jobs.items():
            best[k] = min(best[k], best_of(fn, 1, sync))

    clone_bw, copy_bw = gb / best["clone"], gb / best["copy_"]
    print(f"{'copy: clone()':22s} {clone_bw:7.2f} GB/s  ({best['clone'] * 1e3:7.2f} ms)  <- reference for the ratios")
    print(f"{'copy: out.copy_(x)':22s} {copy_bw:7.2f} GB/s  ({best['copy_'] * 1e3:7.2f} ms)  (preallocated output)")
    for name in names:
        msg = msgs[name]
        y = dec(msg)
        rel = float((y - x).norm() / x.norm())
        for what in ("encode", "decode"):
            t = best[f"{name} {what}"]
            bw = gb / t
            print(f"{name + ' ' + what:22s} {bw:7.2f} GB/s  ({t * 1e3:7.2f} ms)  ratio to clone {bw / clone_bw:5.2f}"
                  f"  to copy_ {bw / copy_bw:5.2f}")
        size = sum(p.ByteSize() for _, p in msg) if args.chunk_bytes else msg.ByteSize()
        print(f"{'':22s} {size / 1e6:.1f} MB on the wire ({size * 8 / args.numel:.2f} bits/element),"
              f" relative L2 error {rel:.4f}")

if __name__ == "__main__":
    main()
