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


# Seconds each swarm module takes on a 2-core CI machine (the median of four fresh-clone runs: docs/benchmarks.md,
# "The swarm suite's order"). Only an ordering hint: a module missing here runs after these.
SWARM_SECONDS = {"test_phase_swarm": 205, "test_walkthrough": 150, "test_split_swarm": 148, "test_multihost": 117,
                 "test_swarm": 115, "test_control_swarm": 98, "test_levels_swarm": 90, "test_nat": 67,
                 "test_links_swarm": 60, "test_auth": 42, "test_netns_swarm": 30, "test_hf_model": 26,
                 "test_disk_full": 14}


def pytest_collection_modifyitems(config, items) -> None:
    """The swarm modules longest first (a stable sort: other modules, and the order within a module, are kept).
    ``make test`` hands whole modules to two workers in this order (``--dist loadfile --no-loadscope-reorder``), so
    neither is left running a long module alone at the end: in the default order (modules with more tests first,
    then by name) the two longest single-test modules came last, and the suite's wall time ranged 588-743 s for
    1120-1224 s of tests."""
    items.sort(key=lambda item: -SWARM_SECONDS.get(item.path.stem, 0))


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
