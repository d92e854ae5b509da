"""``swarm-peer doctor`` names each problem with a fix and exits 1: an initial peer that does not answer, data that
cannot be read. (A good setup against a live swarm: tests/test_control_swarm.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

from test_swarm import REPO


def doctor(*args: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "peer", "doctor", "--config", str(REPO / "configs/demo.toml"),
                           "--json", "--timeout", "5", *args], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def test_doctor_names_an_unreachable_initial_peer_and_unreadable_data(tmp_path):
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmXcxL1H3jpwBUwA1jbMhq4tBW9tfpUoP4ntmBtRKaPnBR"  # (port 9: discard, closed)
    code, report = doctor("--initial-peers", nobody, "--run-dir", str(tmp_path / "a"))
    boot = check(report, "bootstrap")
    assert code == 1 and not report["ok"] and boot["verdict"] == "fail" and nobody in boot["found"], report
    assert boot["fix"] and "swarm" not in {c["name"] for c in report["checks"]}  # no DHT without a bootstrap

    code, report = doctor("--no-network", "--new-swarm", "--data-source", "text",
                          "--data-paths", str(tmp_path / "missing.txt"), "--run-dir", str(tmp_path / "b"))
    data = check(report, "data")
    assert code == 1 and data["verdict"] == "fail" and "missing.txt" in data["found"] and data["fix"], report
    assert check(report, "model")["verdict"] == "ok" and "bootstrap" not in {c["name"] for c in report["checks"]}


def test_the_doctor_says_whether_the_steps_will_be_compiled(monkeypatch):
    """On a CUDA card, ``inner.compile = auto`` compiles where Triton is installed; without it the doctor warns and
    says how to get compiled steps (or to keep eager ones on purpose)."""
    import importlib.util

    import torch

    from peer.run.doctor import CheckVerdict, compiled_steps

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert compiled_steps("auto", cuda) == (CheckVerdict.OK, "steps compiled (inner.compile = auto)", "")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    verdict, steps, hint = compiled_steps("auto", cuda)
    assert verdict == CheckVerdict.WARN and "no Triton" in steps and "install triton" in hint
    assert compiled_steps("off", cuda) == (CheckVerdict.OK, "steps eager (inner.compile = off)", "")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    assert compiled_steps("auto", cuda) == (CheckVerdict.OK, "steps eager (Triton does not support this card)", "")
    assert compiled_steps("on", cuda)[:2] == (CheckVerdict.OK, "steps compiled (inner.compile = on)")


def test_the_doctor_warns_of_a_sparse_codec_under_dilocos_momentum(tmp_path):
    """A sparse codec with DiLoCo's step (momentum 0.9) set by hand works but learns far slower: a warning naming the
    run's settings to change (not a failure: the run is the operator's). FP4 and a sparse codec with the defaults
    (``auto``: each codec's step) pass."""
    base = ("--no-network", "--new-swarm", "--run-dir", str(tmp_path / "r"))
    _, report = doctor(*base)
    outer = check(report, "outer")
    assert outer["verdict"] == "ok" and outer["found"] == "e3m0, outer Nesterov lr 0.7, momentum 0.9", report
    sparse = ("--outer-codec", "topk32", "--outer-error-feedback")
    _, report = doctor(*base, *sparse)
    outer = check(report, "outer")
    assert outer["verdict"] == "ok" and outer["found"] == "topk32, outer Nesterov lr 3, momentum 0.5", report
    _, report = doctor(*base, *sparse, "--outer-lr", "0.7", "--outer-momentum", "0.9")
    outer = check(report, "outer")
    assert outer["verdict"] == "warn" and "momentum 0.9" in outer["found"], report
    assert "outer.lr and outer.momentum = auto (3 and 0.5 with this codec" in outer["fix"], report
