"""What a checkpoint costs the training thread: written in it (``run.checkpoint_background = false``) against
copied in it and written by the writer thread (the default), side by side in one run.

    .venv/bin/python bench/checkpoint_stall.py                          # CPU: 35M preset, 3 checkpoints each
    .venv/bin/python bench/checkpoint_stall.py --device cuda --preset 500M

The peer's step as bench/gpu.py builds it (InnerLoop, StreamingEngine with the echo transport: fragments of 3
blocks, eager, FP4). For each way, ``--saves`` times: the seconds :meth:`RunCheckpoints.save` blocks the
training thread; then, for the background way, the steps made while the writer works, and how much slower
they were than steps without a write (the writer's Python work shares the interpreter). The training thread's
cost of one checkpoint is the block plus that slowdown; the table also states it as a share of the default
10-minute checkpoint interval. Checkpoints go to ``--dir`` (a temporary folder on the disk the run dirs use).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu import INNER, EchoTransport, sync  # noqa: E402
from peer.config import PeerConfig  # noqa: E402
from peer.local.markov import MarkovSource  # noqa: E402
from peer.local.inner import InnerLoop  # noqa: E402
from peer.local.model import build_model, count_parameters  # noqa: E402
from peer.outer.engine import StreamingEngine  # noqa: E402
from peer.outer.settings import OuterSettings  # noqa: E402
from peer.outer.fragments import partition  # noqa: E402
from peer.run.events import EventLog  # noqa: E402
from peer.run.resume import RunCheckpoints  # noqa: E402


class _Source:
    def state_dict(self) -> dict:
        return {"shard": 0, "cursor": 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="35M")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default="runs")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, blocks = build_model(args.preset, args.vocab, args.seq_len)
    model.to(device)
    inner = InnerLoop(model, device=device, **INNER)
    engine = StreamingEngine(partition(model, blocks, 3, "strided"), OuterSettings(H=50, tau=5, eager=True),
                             EchoTransport("e3m0"))
    source = MarkovSource(args.vocab, seed=1)
    batches = [source.next_batch(args.batch, args.seq_len) for _ in range(4)]
    step = [0]

    def train_step() -> float:
        sync(device)
        t0 = time.perf_counter()
        inner.step(batches[step[0] % len(batches)])
        step[0] += 1
        engine.launch_due(step[0])
        engine.apply_due(step[0])
        sync(device)
        return time.perf_counter() - t0

    for _ in range(5):
        train_step()
    baseline = sorted(train_step() for _ in range(10))[5]  # median step without a write
    Path(args.dir).mkdir(parents=True, exist_ok=True)  # (runs/ does not exist in a fresh clone)
    folder = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=args.dir))
    parts = dict(model=model, inner=inner, source=_Source(), engine=engine)
    size = 0
    written: dict[str, list[float]] = {"in the training thread": [], "background (default)": []}
    rows: dict[str, list[tuple[float, float, int]]] = {"in the training thread": [], "background (default)": []}
    try:
        for _ in range(args.saves):
            for way, background in (("in the training thread", False), ("background (default)", True)):
                cfg = PeerConfig()
                cfg.run.checkpoint_background, cfg.run.checkpoint_keep = background, 1
                ckpts = RunCheckpoints(cfg, folder / way.split()[0], EventLog(None))
                t0 = time.perf_counter()
                ckpts.save(step[0], **parts)
                blocked = time.perf_counter() - t0
                during: list[float] = []
                while ckpts.busy():  # steps while the writer works
                    during.append(train_step())
                ckpts.close()
                written[way].append(time.perf_counter() - t0)
                size = sum(f.stat().st_size for f in folder.glob("*/checkpoints/*.swl"))
                slowdown = sum(t - baseline for t in during)
                rows[way].append((blocked, slowdown, len(during)))
    finally:
        engine.close()
        shutil.rmtree(folder, ignore_errors=True)
    n = count_parameters(model)
    print(f"checkpoint stall: preset {args.preset} ({n / 1e6:.0f}M params), device {args.device}, "
          f"{platform.node()}, {datetime.datetime.now():%Y-%m-%d %H:%M}; step {baseline * 1e3:.0f} ms"
          + f"; checkpoints {size / 2e9:.2f} GB each")
    print("| way | written in (s) | blocks the step (s) | steps during the write | their extra time (s) "
          "| training-thread cost (s) | share of a 10-min interval |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    cost = {}
    for way, got in rows.items():
        blocked = sum(b for b, _, _ in got) / len(got)
        extra = sum(s for _, s, _ in got) / len(got)
        steps = sum(k for _, _, k in got) / len(got)
        cost[way] = blocked + extra
        took = sum(written[way]) / len(written[way])
        print(f"| {way} | {took:.2f} | {blocked:.2f} | {steps:.0f} | {extra:.2f} | {blocked + extra:.2f} | "
              f"{100 * (blocked + extra) / 600:.2f}% |")
    ratio = cost["background (default)"] / cost["in the training thread"]
    print(f"background / in the training thread: {ratio:.2f}x the training thread's time per checkpoint")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
