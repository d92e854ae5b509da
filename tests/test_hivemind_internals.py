"""hivemind's private names we rely on (peer/net/plumbing/hivemind_internals.py) still exist: a hivemind upgrade that
renames one fails here, not in a swarm."""

from __future__ import annotations

import importlib
import inspect
import re

from peer.net.plumbing.hivemind_internals import PRIVATE


def _has(obj, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if inspect.isclass(obj):  # an instance attribute: assigned in __init__ or a classmethod that builds it
        source = "".join(inspect.getsource(c) for c in obj.__mro__ if c.__module__.startswith("hivemind"))
        return re.search(rf"(self|\w+)\.{re.escape(name)}\b[^=\n]*=", source) is not None
    return False


def test_every_private_name_we_use_is_still_there():
    missing = []
    for module_name, names in PRIVATE.items():
        module = importlib.import_module(module_name)
        for dotted in names:
            owner, _, attr = dotted.rpartition(".")
            obj = getattr(module, owner) if owner else module
            if not _has(obj, attr):
                missing.append(f"{module_name}.{dotted}")
    assert not missing, missing


def test_the_project_touches_hivemind_private_names_only_there():
    """No module of peer/ or bootstrap/ but hivemind_internals reaches into ``_client`` or the other names."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = ("._client", "FORCE_REACHABILITY_MAPPING", "receive_raw_data =", "protocol.DHTLocalStorage",
             "record_validator, \"_validators\"")
    offenders = [f"{p.relative_to(root)}: {n}" for p in [*root.glob("peer/**/*.py"), *root.glob("bootstrap/*.py")]
                 if p.name != "hivemind_internals.py" for n in names if n in p.read_text()]
    assert not offenders, offenders


def test_the_dht_process_reads_a_message_whole_when_it_arrives_in_two_writes():
    """hivemind's DHT process reads its pipe without blocking as soon as its poll sees bytes; Python writes a
    message over 16 KiB as a header, then the body. A read between the two raised BlockingIOError and killed the
    DHT process; read_whole_messages makes that read wait for the body."""
    import multiprocessing as mp
    import os
    import pickle
    import struct
    import threading

    from peer.net.plumbing.hivemind_internals import _WholeMessages

    message = ("_store", [], {"value": b"x" * 30_000})  # (over 16 KiB, under what a pipe buffers)
    body = pickle.dumps(message)

    def half_written(reader, writer) -> threading.Timer:
        os.set_blocking(reader.fileno(), False)  # (as the DHT process's event loop leaves it)
        assert not reader.poll()
        os.write(writer.fileno(), struct.pack("!i", len(body)))  # the header now, the body a moment later
        assert reader.poll(5)
        fd = writer.fileno()
        timer = threading.Timer(0.3, lambda: os.write(fd, body))
        timer.start()
        return timer

    reader, writer = mp.Pipe(duplex=False)
    timer = half_written(reader, writer)
    try:
        reader.recv()
        raise AssertionError("a non-blocking read of a half-written message did not fail: nothing to fix")
    except BlockingIOError:
        pass
    timer.join()
    reader, writer = mp.Pipe(duplex=False)
    whole = _WholeMessages(reader)
    timer = half_written(whole, writer)
    assert whole.recv() == message  # (waits the 0.3 s for the body)
    timer.join()
    assert not os.get_blocking(reader.fileno())  # (left as the event loop set it)


def test_threads_that_store_large_values_at_once_do_not_corrupt_the_dht_pipe():
    """hivemind's DHT methods send on one pipe from whichever thread calls them, a message over 16 KiB in two
    writes: two threads storing 1 MiB values at once interleaved their bytes and the DHT process died on the
    corrupt message. send_whole_messages lets one message through at a time: the process lives and answers."""
    import threading

    from hivemind.utils import get_dht_time

    from peer.net.plumbing.dht import create_dht

    dht = create_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], identity_path=None,
                     client_mode=False)
    big = {"pad": "x" * (1 << 20)}  # (each refused by the node's storage bounds: only the pipe is tested)
    answered = threading.Event()

    def stores(tag: str) -> None:
        for i in range(20):
            dht.store(f"key-{tag}", big, get_dht_time() + 60, subkey=b"s%d" % i, return_future=True)

    def work() -> None:  # (a dead DHT process leaves senders blocked on a full pipe: the test waits with a deadline)
        threads = [threading.Thread(target=stores, args=(tag,), daemon=True) for tag in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert dht.store("small", 1, get_dht_time() + 60, return_future=True).result(timeout=30)
        assert dht.get("small", latest=True, return_future=True).result(timeout=30).value == 1
        answered.set()

    threading.Thread(target=work, daemon=True).start()
    try:
        assert answered.wait(90), "the DHT process stopped answering: its pipe was corrupted"
        assert dht.is_alive()
    finally:
        if answered.is_set():
            dht.shutdown()
        else:
            dht.kill()
