"""``swarm-peer export``, ``sample`` and ``eval`` (peer/run/export.py, peer/cli/take_home.py).

The swarm case (:func:`assert_exports_agree_and_load_plainly`, run at the end of tests/test_swarm.py's
three-peer test) exports each peer's shared model and loads it in a Python that cannot import swarmloco; the
error cases need no swarm. The README walkthrough (tests/test_walkthrough.py) covers Hugging Face models.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import torch
from helpers import events, in_process

REPO = Path(__file__).resolve().parents[1]

# Loads an exported built-in model with torch, safetensors and the exported modeling.py only (swarmloco's
# package is made unimportable), then prints the logits of a fixed input as JSON.
PLAIN_LOAD = r"""
import json, sys
sys.modules["peer"] = None  # `import peer` now raises ImportError: nothing below may use swarmloco
out = sys.argv[1]
sys.path.insert(0, out)
import torch, modeling
from safetensors.torch import load_model
cfg = json.load(open(f"{out}/config.json"))
model = modeling.Transformer(modeling.ModelShape(**cfg["shape"]), cfg["vocab_size"], cfg["max_seq_len"])
load_model(model, f"{out}/model.safetensors")
tokens = torch.arange(16).remainder(cfg["vocab_size"]).view(1, 16)
print(json.dumps(model.eval()(tokens)[0, -1].tolist()))
"""


def swarm_peer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def swarm_peer_here(*args: str) -> subprocess.CompletedProcess:
    """``swarm-peer ARGS`` through its ``main`` in this process (the suite runs many; one export per test stays a
    real process)."""
    from peer.cli.swarm_peer import main

    return in_process(main, *args)


def assert_exports_agree_and_load_plainly(run_root: Path, names: list[str]) -> None:
    """Called by tests/test_swarm.py once its peers trained together (a swarm of its own would cost a minute):
    each peer's export of the shared model is the same, byte for byte, and loads without swarmloco; ``local``
    weights differ from it; ``sample`` prints a seeded continuation."""
    outs = {name: run_root / f"export-{name}" for name in names}
    for name, out in outs.items():  # the first through a new process, as a user runs it
        done = (swarm_peer if name == names[0] else swarm_peer_here)("export", "--run-dir", str(run_root / name),
                                                                     "--out", str(out))
        assert done.returncode == 0, done.stderr
        assert "model.safetensors" in done.stdout and "modeling.py" in done.stdout
    # The peers applied the same rounds: the same shared weights, byte for byte, and the same provenance.
    prov = {name: json.loads((out / "swarmloco.json").read_text()) for name, out in outs.items()}
    first = prov[names[0]]
    assert all(p["fragments"] == first["fragments"] for p in prov.values()) and first["weights"] == "shared", prov
    assert all(f["round"] >= 1 for f in first["fragments"]), first
    assert len({(out / "model.safetensors").read_bytes() for out in outs.values()}) == 1

    plain = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(outs[names[0]])], capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode == 0, plain.stderr
    from peer.run.export import load_run, run_model

    model = run_model(load_run(run_root / names[0]))
    with torch.no_grad():
        expected = model(torch.arange(16).remainder(256).view(1, 16))[0, -1]
    torch.testing.assert_close(torch.tensor(json.loads(plain.stdout)), expected)
    # The local weights are this peer's own: not the shared ones (it trained after its last sync).
    local = run_model(load_run(run_root / names[0]), "local")
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), local.state_dict().values()))

    sample = swarm_peer_here("sample", "--run-dir", str(run_root / names[0]), "--prompt", "ab", "--tokens", "24")
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("ab") and len(sample.stdout.rstrip("\n")) > 2, sample.stdout
    again = swarm_peer_here("sample", "--run-dir", str(run_root / names[0]), "--prompt", "ab", "--tokens", "24")
    assert again.stdout == sample.stdout  # seeded: the same text twice

    # ... and measured: the same held-out loss from every peer's checkpoint (the same shared weights), lower than the
    # untrained model's, a number as the peers' own evaluations report it
    held = {}
    for name in names:
        done = swarm_peer_here("eval", "--run-dir", str(run_root / name), "--sequences", "32")
        assert done.returncode == 0, done.stderr
        held[name] = float(re.match(r"held-out loss (\S+) nats, perplexity ", done.stdout).group(1))
    assert len(set(held.values())) == 1, held
    last_eval = events(run_root, names[0], "eval")[-1]["loss"]
    assert held[names[0]] < math.log(256) and abs(held[names[0]] - last_eval) < 0.5, (held, last_eval)


def test_export_and_sample_name_what_to_fix(tmp_path):
    empty = tmp_path / "run"
    (empty / "checkpoints").mkdir(parents=True)
    for args in (["export", "--run-dir", str(empty), "--out", str(tmp_path / "out")],
                 ["sample", "--run-dir", str(empty), "--prompt", "x"],
                 ["eval", "--run-dir", str(empty)],
                 ["export", "--run-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]):
        done = (swarm_peer if args[0] == "sample" else swarm_peer_here)(*args)
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("swarm-peer: error: --run-dir"), done.stderr
