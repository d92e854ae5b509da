"""A full disk is a warning, not the end of a peer: checkpoints, the event log and the log file keep the peer
training, keep what was written, and work again once there is room.

The real test puts a peer's run dir on a small tmpfs (root only; skipped where mounting is not allowed), fills
it while the peer trains, and frees it again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import Proc, wait_for
from peer.run import checkpoint
from peer.run.events import EventLog

REPO = Path(__file__).resolve().parents[1]
# A tiny-preset checkpoint without eager terms is ~29 MB (model, AdamW moments, G, v, S): one fits, two do not
# once the filler has taken the rest.
DISK_MB = 80


def test_event_log_on_a_full_device_drops_events_and_warns_once(caplog):
    log = EventLog("/dev/full")  # every write fails with ENOSPC
    with caplog.at_level(logging.WARNING):
        for i in range(5):
            log.emit("step", step=i)
    log.close()
    assert log.dropped == 5
    warnings = [r.getMessage() for r in caplog.records if "event log" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]


def test_log_file_on_a_full_device_warns_once_without_tracebacks(tmp_path, capfd):
    """logging's default prints a traceback for every line it cannot write; ours says it once."""
    from peer.run.events import setup_logging

    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        setup_logging("INFO", Path("/dev/full"), "peer test")
        for i in range(5):
            logging.getLogger("peer.test").info("line %d", i)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(saved[0])
        for handler in saved[1]:
            root.addHandler(handler)
    err = capfd.readouterr().err
    assert err.count("cannot write the log file /dev/full") == 1 and "Traceback" not in err
    assert err.count("line ") == 5  # the console still has every line


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Writes zeros into ``path`` until the filesystem is full."""
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError:
            pass
        try:  # the last partial megabyte
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.mark.swarm
@pytest.mark.timeout(400)
def test_full_disk_while_training_keeps_the_peer_and_its_checkpoint(procs, tmp_path, small_disk):
    run_dir = small_disk / "run"
    peer = Proc.start([sys.executable, "-m", "peer", "run", "--config", str(REPO / "configs/demo.toml"),
                       "--new-swarm", "--min-peers", "1", "--run-dir", str(run_dir), "--log-json",
                       str(run_dir / "events.jsonl"), "--model-seq-len", "32", "--data-batch-size", "4",
                       "--status-interval", "0", "--log-every", "5", "--checkpoint-minutes", "0.02"],
                      log_path=tmp_path / "peer.log", cwd=REPO)  # the console log is not on the small disk
    procs.append(peer)
    first = int(peer.wait_for_line(r"checkpoint at step (\d+): ", timeout=180).group(1))
    fill(small_disk / "filler")
    at = len(peer.lines())
    failed = peer.wait_for_line(r"checkpoint at step (\d+) not written \(No space left on device\); keeping "
                                r"ckpt-\d+\.swl and training on", timeout=120, start=at)
    steps_when_full = int(failed.group(1))
    kept = checkpoint.load_latest(run_dir / "checkpoints")
    assert kept is not None and kept[1]["step"] >= first  # the previous checkpoint is intact
    # no half-written file stays to take space (a retry in flight may hold a new one for a moment: so the check
    # waits for the failed ones' files to go, and does not ask that none exist)
    stale = set((run_dir / "checkpoints").glob(".ckpt-*.tmp"))
    wait_for(lambda: not stale & set((run_dir / "checkpoints").glob(".ckpt-*.tmp")), 30,
             f"the temporary files of failed checkpoints to go: {sorted(p.name for p in stale)}")
    # the failed checkpoint freed the space its file had taken, and events may be written there: fill it too, so
    # the disk stays full until the fillers go
    fill(small_disk / "filler-2")
    peer.wait_for_line(r"event log .* cannot write \(No space left on device\)", timeout=60, start=at)
    assert peer.returncode is None, peer.tail()

    for name in ("filler", "filler-2"):  # room again
        (small_disk / name).unlink()
    at = len(peer.lines())
    again = int(peer.wait_for_line(r"checkpoint at step (\d+): ", timeout=120, start=at).group(1))
    assert again > steps_when_full
    peer.wait_for_line(r"event log .* writing again, \d+ event\(s\) were lost", timeout=60, start=at)
    peer.popen.send_signal(signal.SIGTERM)
    wait_for(lambda: peer.returncode is not None, 60, "the peer to stop")
    assert peer.returncode == 0, peer.tail()
    assert "Traceback" not in "\n".join(peer.lines())
    # Every complete line of the event log parses (a line cut by the full disk stays a line of its own).
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines if line.endswith("}")]
    assert parsed[-1]["event"] == "stop"
    assert any(e["event"] == "step" and e["step"] > steps_when_full for e in parsed)  # written after the room came
    assert checkpoint.load_latest(run_dir / "checkpoints")[1]["step"] >= again


def test_event_log_keeps_whole_lines_when_two_threads_emit(tmp_path):
    """The training thread and the checkpoint writer both emit: every event is one whole JSON line."""
    import threading

    log = EventLog(str(tmp_path / "events.jsonl"))
    payload = "x" * 5000  # (long lines: a write may take more than one os.write)

    def emit(name: str) -> None:
        for i in range(300):
            log.emit(name, i=i, payload=payload)

    threads = [threading.Thread(target=emit, args=(name,)) for name in ("train", "writer")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    log.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    expected = sorted((name, i) for name in ("train", "writer") for i in range(300))
    assert sorted((e["event"], e["i"]) for e in events) == expected
