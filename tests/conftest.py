"""Shared fixtures: ``procs`` (processes killed, with their p2pd daemons, at teardown) and ``repo_python``; the codec
kernels compiled once before xdist starts its workers."""

from __future__ import annotations

import os
import signal
import sys

import helpers
import pytest
from helpers import Proc, wait_for


def pytest_configure(config) -> None:
    """Peers and bootstrap nodes are forked from a zygote that has imported them (``tests/forks.py``; set
    ``TESTS_EXEC_PEERS=1`` to start each as a new interpreter). Under xdist, the controller compiles numba's codec
    kernels into their cache before the workers start: in a fresh checkout each worker, and each zygote started
    before the cache is written, would otherwise compile them itself (9 s cold against under 3 s from the cache)."""
    helpers.FORK = os.environ.get("TESTS_EXEC_PEERS") != "1"
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from peer.outer import cpu_path

        cpu_path.kernels()


@pytest.fixture
def repo_python() -> str:
    """The virtualenv's python (the one running pytest): use it to start ``-m peer`` / ``-m bootstrap``."""
    return sys.executable


@pytest.fixture
def procs():
    """A list to append started ``Proc``s to. At teardown every process group still alive is SIGKILLed
    (p2pd grandchildren included: they share the session) and nothing of theirs may remain."""
    started: list[Proc] = []
    yield started
    for proc in started:
        if proc.returncode is None or proc.session_pids():
            proc.kill_group(signal.SIGKILL)
    try:
        wait_for(lambda: not any(p.session_pids() for p in started), timeout=10, what="killed process groups to go")
    except TimeoutError:
        pass
    left = {p.pid: p.session_pids() for p in started if p.session_pids()}
    assert not left, f"processes survived SIGKILL of their group (session leader pid -> pids): {left}"


@pytest.fixture
def one_torch_thread():
    """Tiny CPU models gain nothing from intra-op threads, and on a shared 2-core box (other tests,
    a demo swarm) spinning OpenMP workers made the training tests ~7x slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
