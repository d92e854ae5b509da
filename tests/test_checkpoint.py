"""Checkpoints: atomic writes, corruption detection, keep-K, and resuming a real peer process."""

import errno
import io
import logging
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from helpers import Proc, events, wait_for
from peer.run import checkpoint

REPO = Path(__file__).resolve().parents[1]


def payload(i):
    return {"step": i, "w": torch.full((1000,), float(i)), "nested": {"cursor": i, "name": "x", "none": None}}


def test_round_trip_and_keep_last_k(tmp_path):
    for i in range(1, 6):
        checkpoint.save(tmp_path, i, payload(i), keep=3)
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.swl"))
    assert names == [f"ckpt-{i:010d}.swl" for i in (3, 4, 5)]
    path, state = checkpoint.load_latest(tmp_path)
    assert path.name == names[-1] and state["step"] == 5 and torch.equal(state["w"], torch.full((1000,), 5.0))
    assert state["nested"] == {"cursor": 5, "name": "x", "none": None}
    assert not list(tmp_path.glob(".ckpt-*"))  # no temporary files left


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:-10] + bytes([b[-10] ^ 0x01]) + b[-9:], "checksum mismatch"),
    (lambda b: b"garbage", "not a swarmloco checkpoint"),
])
def test_damaged_newest_checkpoint_is_reported_and_the_previous_used(tmp_path, caplog, damage, reason):
    checkpoint.save(tmp_path, 1, payload(1))
    newest = checkpoint.save(tmp_path, 2, payload(2))
    newest.write_bytes(damage(newest.read_bytes()))
    with caplog.at_level(logging.WARNING):
        path, state = checkpoint.load_latest(tmp_path)
    assert state["step"] == 1
    assert any(newest.name in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    with pytest.raises(checkpoint.CheckpointError, match=reason):
        checkpoint.read(newest)


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.1, 0.5, 0.99])
def test_a_full_disk_at_any_byte_is_an_oserror_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch, fraction):
    """Wherever the disk fills, the caller sees ENOSPC (torch's archive writer would turn most of them into its
    own RuntimeError while it closes the archive) and the previous checkpoint is the newest."""
    size = checkpoint.save(tmp_path, 1, payload(1)).stat().st_size
    room = int(fraction * size)
    real_fdopen = checkpoint.os.fdopen

    class Disk(io.RawIOBase):
        """A file on a disk with ``room`` bytes left."""

        def __init__(self, fd):
            super().__init__()
            self.f, self.left = real_fdopen(fd, "wb"), room

        def writable(self):
            return True

        def write(self, data):
            if len(data) > self.left:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.left -= len(data)
            return self.f.write(data)

        def seek(self, *args):
            return self.f.seek(*args)

        def flush(self):
            self.f.flush()

        def fileno(self):
            return self.f.fileno()

        def close(self):
            super().close()  # (flushes first)
            self.f.close()

    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: Disk(fd))
    with pytest.raises(OSError) as failed:
        checkpoint.save(tmp_path, 2, payload(2))
    assert failed.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert checkpoint.load_latest(tmp_path)[1]["step"] == 1
    assert not list(tmp_path.glob(".ckpt-*"))


def test_nothing_to_load(tmp_path):
    assert checkpoint.load_latest(tmp_path / "missing") is None


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    """A process writing large checkpoints in a loop is SIGKILLed mid-write; the newest complete
    checkpoint still verifies and loads."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from peer.run import checkpoint
        big = torch.randn(8_000_000)  # 32 MB: a write takes long enough to be interrupted
        for i in range(1, 1000):
            checkpoint.save({str(tmp_path)!r}, i, {{"step": i, "w": big}}, keep=2)
            print("saved", i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("saved 1")
        # kill while the next write is under way (a temporary file exists)
        wait_for(lambda: list(tmp_path.glob(".ckpt-*.tmp")), 60, "a checkpoint write in progress")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    path, state = checkpoint.load_latest(tmp_path)
    assert state["step"] >= 1 and state["w"].numel() == 8_000_000


FAST = ["--model-seq-len", "32", "--data-batch-size", "4", "--outer-sync-every", "20", "--status-interval", "0",
        "--log-every", "10", "--new-swarm", "--min-peers", "1", "--progress-period", "1", "--progress-ttl", "8",
        "--dht-timeout", "3", "--request-timeout", "1", "--matchmaking-time", "10"]


def run_peer(procs, tmp_path, name, *extra):
    run_dir = tmp_path / "run"
    proc = Proc.start([sys.executable, "-m", "peer", "run", "--config", str(REPO / "configs/demo.toml"),
                       "--run-dir", str(run_dir), "--log-json", str(run_dir / "events.jsonl"), *FAST, *extra],
                      log_path=tmp_path / f"{name}.log", cwd=REPO)
    procs.append(proc)
    return proc


def test_peer_resumes_after_clean_stop_and_after_kill_9(procs, tmp_path):
    first = run_peer(procs, tmp_path, "first", "--max-steps", "30")
    wait_for(lambda: first.returncode is not None, 180, "first run to finish")
    assert first.returncode == 0, first.tail()
    assert any("checkpoint at step 30" in line for line in first.lines())
    # where the loop's time went: the parts add up to the training time, the inner steps to its compute seconds
    last = events(tmp_path, "run", "step")[-1]
    parts = last["loop_seconds"]
    assert {"step", "launch", "apply", "checkpoint", "rest"} <= set(parts), parts
    assert parts["step"] == pytest.approx(last["compute_seconds"], abs=0.01 + 0.01 * last["compute_seconds"])
    assert sum(parts.values()) <= last["elapsed"] + 0.01, (parts, last["elapsed"])
    # The run dir alone describes the run: the checkpoint holds the resolved config. Eager is off, so it holds
    # six fp32 copies of the model (weights, AdamW's two moments, G, v, S), not eight.
    path, state = checkpoint.load_latest(tmp_path / "run" / "checkpoints")
    assert state["config"]["outer"]["sync_every"] == 20 and state["config"]["run"]["max_steps"] == 30
    assert state["config"]["run"]["run_dir"] == str(tmp_path / "run")
    model_bytes = 4 * sum(t.numel() for t in {t.data_ptr(): t for t in state["model"].values()}.values())  # tied once
    assert path.stat().st_size < 6.2 * model_bytes, (path.stat().st_size, model_bytes)

    second = run_peer(procs, tmp_path, "second", "--max-steps", "100000", "--checkpoint-minutes", "0.01")
    second.wait_for_line(r"resumed from ckpt-0000000030\.swl at step 30", timeout=180)
    m = second.wait_for_line(r"checkpoint at step (\d+): ", timeout=180)
    saved = int(m.group(1))
    assert saved > 30
    second.kill_group(signal.SIGKILL)  # a crash: only what was checkpointed survives
    wait_for(lambda: not second.session_pids(), 15, "the killed peer to be gone")

    third = run_peer(procs, tmp_path, "third", "--max-steps", str(saved + 10))
    m = third.wait_for_line(r"resumed from ckpt-\d+\.swl at step (\d+)", timeout=180)
    assert int(m.group(1)) >= saved
    wait_for(lambda: third.returncode is not None, 180, "third run to finish")
    assert third.returncode == 0, third.tail()
    assert any(f"stopping after step {saved + 10}" in line for line in third.lines())


def test_checkpoint_of_another_run_is_refused(procs, tmp_path):
    first = run_peer(procs, tmp_path, "first", "--max-steps", "10")
    wait_for(lambda: first.returncode is not None, 180, "first run to finish")
    other = run_peer(procs, tmp_path, "other", "--max-steps", "10", "--outer-lr", "0.5")
    wait_for(lambda: other.returncode is not None, 180, "second run to exit")
    assert other.returncode == 2
    assert any("holds a checkpoint of another run" in line for line in other.lines())


class _Parts:
    """What RunCheckpoints.save reads, without a trainer: a model, an inner loop, a data source, an engine."""

    def __init__(self):
        self.model = torch.nn.Linear(4, 4)
        self.inner = self.source = self.engine = self

    def check_finite(self):
        pass

    def state_dict(self):
        return {"w": self.model.weight}  # the live tensor, as state_dict()s hand it out

    def immutable_tensors(self):
        return []

    def parts(self):
        return dict(model=self.model, inner=self.inner, source=self.source, engine=self.engine)


def _checkpoints(tmp_path, **run):
    from peer.config import PeerConfig
    from peer.run.events import EventLog
    from peer.run.resume import RunCheckpoints

    cfg = PeerConfig()
    for k, v in run.items():
        setattr(cfg.run, k, v)
    return RunCheckpoints(cfg, tmp_path, EventLog(None))


def test_a_background_checkpoint_holds_the_state_of_its_step_and_the_newest_waiting_one_wins(tmp_path, monkeypatch):
    """The training thread copies the state and goes on; the writer thread writes it. Training after the save
    does not leak into it; saves asked for while one is written replace the one waiting (one write at a time)."""
    from peer.run import resume

    p, ckpts = _Parts(), _checkpoints(tmp_path)
    started, release, written = threading.Event(), threading.Event(), []
    real_save = checkpoint.save

    def slow_save(folder, step, payload, keep=3):
        started.set()
        assert release.wait(30), "never released"
        written.append(step)
        return real_save(folder, step, payload, keep=keep)

    monkeypatch.setattr(resume.checkpoint, "save", slow_save)
    with torch.no_grad():
        p.model.weight.fill_(1.0)
    ckpts.save(1, **p.parts())
    assert started.wait(30)  # the writer holds step 1; the training thread is free
    with torch.no_grad():
        p.model.weight.fill_(2.0)  # training goes on
    ckpts.save(2, **p.parts())
    with torch.no_grad():
        p.model.weight.fill_(3.0)
    ckpts.save(3, **p.parts())  # replaces step 2, which was still waiting
    with torch.no_grad():
        p.model.weight.fill_(4.0)
    release.set()
    ckpts.close()
    assert written == [1, 3]
    saved = {int(f.stem.split("-")[1]): checkpoint.read(f) for f in (tmp_path / "checkpoints").glob("ckpt-*.swl")}
    assert sorted(saved) == [1, 3]
    assert saved[1]["model"]["weight"].eq(1.0).all() and saved[3]["model"]["weight"].eq(3.0).all()
    assert saved[3]["engine"]["w"].eq(3.0).all()


def test_a_background_checkpoint_shares_the_outer_state_and_still_holds_that_of_its_step(tmp_path, monkeypatch):
    """G and v are replaced, never written in place: the copy for the writer holds them as they are (no second
    copy of the outer state in host memory), and rounds applied while it waits do not reach the file."""
    from peer.outer.engine import StreamingEngine
    from peer.outer.fragments import Fragment
    from peer.outer.rounds import RoundOutcome, Span
    from peer.outer.settings import OuterSettings
    from peer.run import resume
    from test_streaming_engine import ScriptedTransport

    def whole(f, r, d):
        return RoundOutcome(f, r, "ok", spans=[Span(0, 8, d.clone())], total_weight=2.0)

    p, ckpts = _Parts(), _checkpoints(tmp_path)
    w = torch.nn.Parameter(torch.zeros(8))
    p.engine = StreamingEngine([Fragment(0, ["w"], [w])], OuterSettings(H=2, tau=1), ScriptedTransport(whole))

    def train(steps):
        for step in steps:
            with torch.no_grad():
                w.sub_(1.0)
            p.engine.launch_due(step)
            p.engine.apply_due(step)

    train(range(1, 5))
    at_save = (p.engine.states[0].G, p.engine.states[0].G.clone())
    started, release, held = threading.Event(), threading.Event(), []
    real_save = checkpoint.save

    def slow_save(folder, step, payload, keep=3):
        held.append(payload["engine"]["fragments"][0]["G"])
        started.set()
        assert release.wait(30), "never released"
        return real_save(folder, step, payload, keep=keep)

    monkeypatch.setattr(resume.checkpoint, "save", slow_save)
    ckpts.save(4, **p.parts())
    assert started.wait(30)
    train(range(5, 9))  # two more rounds applied while the writer waits
    release.set()
    ckpts.close()
    p.engine.close()
    assert held[0] is at_save[0]  # shared, not copied
    assert not torch.equal(p.engine.states[0].G, at_save[1])
    _, saved = checkpoint.load_latest(tmp_path / "checkpoints")
    assert torch.equal(saved["engine"]["fragments"][0]["G"], at_save[1])


def test_a_failed_background_write_is_tried_again_and_a_waited_save_is_written_before_it_returns(tmp_path,
                                                                                                monkeypatch):
    from peer.run import resume

    p, ckpts = _Parts(), _checkpoints(tmp_path, checkpoint_minutes=0.0)
    monkeypatch.setattr(resume, "RETRY_S", 0.0)
    real_save, fail = checkpoint.save, [True]

    def full_disk(folder, step, payload, keep=3):
        if fail[0]:
            raise OSError(28, "No space left on device")
        return real_save(folder, step, payload, keep=keep)

    monkeypatch.setattr(resume.checkpoint, "save", full_disk)
    assert not ckpts.retry_due()
    ckpts.save(5, **p.parts())
    wait_for(ckpts.retry_due, 30, "the failed write to ask for a retry")
    fail[0] = False
    ckpts.save(6, **p.parts(), wait=True)  # a stop: written when save returns
    assert checkpoint.load_latest(tmp_path / "checkpoints")[1]["step"] == 6
    assert not ckpts.retry_due()
    ckpts.close()
    ckpts.save(7, **p.parts(), wait=True)  # still possible after close (the final save of a run)
    assert checkpoint.load_latest(tmp_path / "checkpoints")[1]["step"] == 7


def test_the_checkpoint_policy_saves_every_n_rounds_once_a_round_applied_and_every_m_minutes(tmp_path, monkeypatch):
    """RunCheckpoints.save_if_due owns the policy the training loop used to hold: run.checkpoint_rounds more rounds
    done (only once one applied), run.checkpoint_minutes since its last save; its clocks start at its first call."""
    ckpts = _checkpoints(tmp_path, checkpoint_rounds=3, checkpoint_minutes=0.0)
    saved = []
    monkeypatch.setattr(ckpts, "save", lambda step, **parts: saved.append(step))
    assert not ckpts.save_if_due(1, rounds_done=5, applied=True)  # (the clocks start here)
    assert not ckpts.save_if_due(2, rounds_done=7, applied=True)
    assert not ckpts.save_if_due(3, rounds_done=8, applied=False)  # no round applied yet
    assert ckpts.save_if_due(4, rounds_done=8, applied=True) and saved == [4]
    assert not ckpts.save_if_due(5, rounds_done=10, applied=True)
    timed = _checkpoints(tmp_path, checkpoint_rounds=0, checkpoint_minutes=1.0)
    monkeypatch.setattr(timed, "save", lambda step, **parts: saved.append(step))
    clock = iter([1000.0, 1030.0, 1061.0, 1061.0])
    monkeypatch.setattr("peer.run.resume.time.monotonic", lambda: next(clock))
    assert not timed.save_if_due(1, rounds_done=0, applied=False)
    assert not timed.save_if_due(2, rounds_done=0, applied=False)
    assert timed.save_if_due(3, rounds_done=0, applied=False) and saved == [4, 3]
