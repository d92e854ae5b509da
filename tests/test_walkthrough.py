"""README "Train a real model": every command of the section, run as written (in a scratch directory that sees
the repository's configs), and the Python snippet that loads the exported model without swarmloco.

The peers are the section's two `run` commands; the test checks what the section promises: they train
together (the same digest after every round), the loss falls, and the exported model loads in transformers.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import Proc, assert_one_digest_per_applied_round, events
from test_swarm import wait_exit

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtualenv's console scripts (what `.venv/bin/` names in the README)


def section() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("## Train a real model\n", 1)[1].split("\n## ", 1)[0]


def commands() -> list[list[str]]:
    """The shell commands of the section's ```sh block, as argv lists (comments dropped)."""
    block = re.search(r"```sh\n(.*?)```", section(), re.S)
    assert block, "the section has a ```sh block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def argv(cmd: list[str], peers: list[str]) -> list[str]:
    assert cmd[0].startswith(".venv/bin/"), cmd
    out = [str(BIN / cmd[0].removeprefix(".venv/bin/"))]
    for word in cmd[1:]:
        out += peers if word == "$PEERS" else [word]
    return out


def corpus_losses(run_dir: Path, data: Path) -> tuple[float, float]:
    """The mean cross-entropy over every sequence of the prepared corpus of the run's model at its initial weights
    (``model.init_seed``, as every peer builds it) and at the swarm's shared weights of its last checkpoint: the
    loss the section promises falls, measured the same way twice (one batch's loss varies by about 0.1 nats)."""
    import numpy as np
    import torch

    from peer.local.inner import mean_ce
    from peer.local.model import build_model
    from peer.run.export import load_run, run_model

    saved = load_run(run_dir)
    cfg = saved.cfg
    manifest = json.loads((data / "manifest.json").read_text())
    tokens = np.concatenate([np.fromfile(data / s["file"], dtype=manifest["dtype"]) for s in manifest["shards"]])
    width = cfg.model.seq_len + 1
    rows = torch.from_numpy(tokens[: len(tokens) // width * width].astype(np.int64)).view(-1, width)
    torch.manual_seed(cfg.model.init_seed)
    initial, _ = build_model(cfg.model.preset, cfg.data.vocab_size, cfg.model.seq_len, cfg.model.factory or None,
                             hf_config=cfg.model.hf_config, hf_blocks=cfg.model.hf_blocks)
    return mean_ce(initial, rows, chunk=16), mean_ce(run_model(saved, "shared"), rows, chunk=16)


def test_the_readme_walkthrough_trains_exports_and_samples_a_real_model(procs, tmp_path, monkeypatch):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    cmds = commands()
    kinds = [c[1] if c[0].endswith("swarm-peer") else "bootstrap" for c in cmds]
    assert kinds == ["prepare-data", "bootstrap", "run", "run", "export", "sample"], kinds

    def run(cmd: list[str], peers: list[str] = ()) -> str:
        done = subprocess.run(argv(cmd, list(peers)), cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{shlex.join(cmd)}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    prepared = run(cmds[0])
    assert "source = \"tokens\"" in prepared, prepared
    boot = Proc.start(argv(cmds[1], []), log_path=tmp_path / "boot.log", cwd=tmp_path)
    procs.append(boot)
    peers = boot.wait_for_line(r"^--initial-peers (.+)$", timeout=60).group(1).split()
    runs = []
    names = [cmd[cmd.index("--run-dir") + 1].removeprefix("runs/") for cmd in cmds[2:4]]
    for name, cmd in zip(names, cmds[2:4]):
        proc = Proc.start(argv(cmd, peers) + ["--log-json", str(tmp_path / "runs" / name / "events.jsonl")],
                          log_path=tmp_path / f"{name}.log", cwd=tmp_path)
        procs.append(proc)
        runs.append(proc)
    for proc in runs:
        assert wait_exit(proc, 400) == 0, proc.tail()

    rounds = [{(e["fragment"], e["round"]): e for e in events(tmp_path / "runs", name, "round")} for name in names]
    both = sorted(set(rounds[0]) & set(rounds[1]))
    ok = [k for k in both if rounds[0][k]["status"] == rounds[1][k]["status"] == "ok"]
    assert len(ok) >= 4, (sorted(rounds[0]), sorted(rounds[1]))
    assert_one_digest_per_applied_round(tmp_path / "runs", names, shared=4)  # every round both applied, no filter
    monkeypatch.chdir(tmp_path)  # the config's paths are relative to where the peers ran
    theta_0, shared = corpus_losses(tmp_path / "runs" / names[0], tmp_path / "runs" / "data")
    assert shared < theta_0 - 0.5, (theta_0, shared)

    exported = run(cmds[4])
    assert "model.safetensors" in exported and "tokenizer.json" in exported, exported
    sampled = run(cmds[5])
    assert sampled.startswith("The river") and len(sampled.strip()) > len("The river"), sampled

    snippet = re.search(r"```python\n(.*?)```", section(), re.S)
    assert snippet, "the section shows how to load the exported model"
    code = "import sys\nsys.modules['peer'] = None  # swarmloco is not importable below\n" + snippet.group(1)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("The river"), done.stdout
