"""peer/util.py: a blocking wait into the networking thread that a stop cuts short (state downloads at Ctrl-C); the
CPU time of each thread."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from peer.util import Stopped, result_or_stop, thread_cpu_seconds


def test_a_stop_cancels_the_wait_and_the_work_at_once():
    work: concurrent.futures.Future = concurrent.futures.Future()  # never completes on its own
    stop = threading.Event()
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        result_or_stop(work, timeout=60.0, stop=stop, poll=0.05)
    assert time.monotonic() - t0 < 5.0 and work.cancelled()  # not the 60 s timeout
    timer.join()


def test_a_result_is_returned_and_a_timeout_cancels_the_work():
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(7)
    assert result_or_stop(done, timeout=1.0, stop=threading.Event()) == 7
    late: concurrent.futures.Future = concurrent.futures.Future()
    with pytest.raises(concurrent.futures.TimeoutError):
        result_or_stop(late, timeout=0.2, stop=None, poll=0.05)
    assert late.cancelled()


def test_thread_cpu_seconds_names_each_live_thread_and_sums_a_pool():
    """The CPU time of each live thread by its name, a pool's numbered workers (``digest_0``, ``digest_1``) under
    their prefix: what the stop event reports of the threads that shared the training thread's process."""
    spent, release = [threading.Event() for _ in range(2)], threading.Event()

    def spin(done: threading.Event) -> None:
        while time.thread_time() < 0.05:
            pass
        done.set()
        release.wait(10)

    threads = [threading.Thread(target=spin, args=(spent[i],), name=f"digest_{i}") for i in range(2)]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(10) for e in spent)
        cpu = thread_cpu_seconds()
    finally:
        release.set()
        for t in threads:
            t.join(10)
    assert cpu["digest"] >= 0.1 and "digest_0" not in cpu and "MainThread" in cpu, cpu
