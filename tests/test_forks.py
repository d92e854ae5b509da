"""The tests' zygote (``tests/forks.py``): a forked ``python -m peer|bootstrap`` behaves as a new interpreter would
(output, exit codes, signals, session, cwd, network namespace), so swarm tests may start their peers that way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import forks
import helpers
import pytest
from helpers import Proc, wait_for
from netns import NetnsLab, netns_available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
BOOT = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path", "boot.id"]
READY = r"^--initial-peers (/\S+(?: /\S+)*)$"


def test_forkable_takes_this_pythons_module_commands_with_or_without_a_netns():
    assert forks.forkable([PY, "-m", "peer", "run", 3]) == (None, "peer", ["run", "3"])
    assert forks.forkable(["/usr/sbin/ip", "netns", "exec", "h0", PY, "-m", "bootstrap"]) == ("h0", "bootstrap", [])
    for other in ([PY, "-m", "pytest"], ["/other/python", "-m", "peer"], [PY, "peer"],
                  ["ip", "netns", "exec", "h0", "taskset", "-c", "0", PY, "-m", "peer"], [PY, "-m"]):
        assert forks.forkable(other) is None, other


ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def zygote():
    z = forks.Zygote(ENV)
    yield z
    z.close()


def fork(zygote, procs, tmp_path, name: str, args: list[str]) -> Proc:
    netns, module, argv = forks.forkable(args)
    proc = Proc(zygote.spawn(module, argv, env=ENV, log=tmp_path / f"{name}.log", cwd=str(tmp_path), netns=netns),
                tmp_path / f"{name}.log", args)
    procs.append(proc)
    return proc


def test_a_zygote_serves_every_test_but_no_other_environment(zygote, procs, tmp_path):
    assert zygote.serves({**ENV, "PYTEST_CURRENT_TEST": "another test (pytest names each one)"})
    assert not zygote.serves({**ENV, "HIVEMIND_LOGLEVEL": "DEBUG"})  # read at import: a new interpreter's
    if helpers.FORK:  # (as conftest sets it, unless TESTS_EXEC_PEERS=1)
        proc = Proc.start([PY, "-m", "peer", "run", "--help"], log_path=tmp_path / "help.log", cwd=tmp_path)
        procs.append(proc)
        assert isinstance(proc.popen, forks.Forked)
        assert proc.popen.wait(timeout=60) == 0 and "--config" in "\n".join(proc.lines())


def test_bad_input_gives_the_same_line_and_code_as_a_new_interpreter(zygote, procs, tmp_path):
    args = [PY, "-m", "peer", "run", "--config", str(tmp_path / "missing.toml")]
    forked = fork(zygote, procs, tmp_path, "forked", args)
    new = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert new.returncode != 0
    assert forked.popen.wait(timeout=60) == new.returncode
    assert forked.lines() == (new.stdout + new.stderr).splitlines()


def test_a_forked_bootstrap_has_its_own_session_and_cwd_and_stops_on_signals(zygote, procs, tmp_path):
    first = fork(zygote, procs, tmp_path, "first", [PY, "-m", "bootstrap", *BOOT])
    first.wait_for_line(READY, timeout=60)
    assert os.getsid(first.pid) == first.pid and os.getpgid(first.pid) == first.pid
    assert os.readlink(f"/proc/{first.pid}/cwd") == str(tmp_path)
    assert (tmp_path / "boot.id").exists()
    assert len(first.session_pids()) >= 2  # itself and its p2pd, in its session
    assert first.popen.poll() is None
    first.popen.send_signal(signal.SIGINT)  # Ctrl-C is a clean stop
    assert first.popen.wait(timeout=30) == 0, first.tail()
    wait_for(lambda: not first.session_pids(), 10, "the bootstrap's p2pd to exit")

    second = fork(zygote, procs, tmp_path, "second", [PY, "-m", "bootstrap", *BOOT])
    second.wait_for_line(READY, timeout=60)
    with pytest.raises(subprocess.TimeoutExpired):
        second.popen.wait(timeout=0.1)
    second.popen.send_signal(signal.SIGKILL)
    assert second.popen.wait(timeout=10) == -signal.SIGKILL


def test_a_forked_bootstrap_runs_in_the_network_namespace_it_is_given(zygote, procs, tmp_path):
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)
    with NetnsLab(1) as lab:
        args = lab.run_args(0, [PY, "-m", "bootstrap", "--host-maddrs", f"/ip4/{lab.addr(0)}/tcp/0",
                                "--identity-path", "boot.id"])
        boot = fork(zygote, procs, tmp_path, "boot", args)
        maddrs = boot.wait_for_line(READY, timeout=60).group(1)
        assert f"/ip4/{lab.addr(0)}/" in maddrs
        assert os.stat(f"/proc/{boot.pid}/ns/net").st_ino == os.stat(f"/run/netns/{lab.host(0)}").st_ino
        assert boot.terminate(timeout=30) == 0, boot.tail()
