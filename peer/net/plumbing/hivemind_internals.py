"""Every use of hivemind 1.1.12's private API, in one place: what a hivemind upgrade must be checked against.

Each function below wraps one private attribute and says why no public API serves; ``PRIVATE`` lists them all
(with the one private method we override, ``Matchmaking._check_reasons_to_reject`` in peer/net/round/matchmaking.py),
and tests/test_hivemind_internals.py checks that each still exists. Nothing else in the project touches
hivemind's private names.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

PRIVATE = {  # module: the private names we rely on
    "hivemind.dht.dht": ["DHT._inner_pipe", "DHT._outer_pipe"],
    "hivemind.p2p.p2p_daemon": ["P2P._client", "P2P.receive_raw_data", "P2P.FORCE_REACHABILITY_MAPPING"],
    "hivemind.dht.protocol": ["DHTLocalStorage", "DHTProtocol.record_validator", "DHTProtocol.authorizer"],
    "hivemind.dht.validation": ["CompositeValidator._validators"],
    "hivemind.averaging.matchmaking": ["Matchmaking._check_reasons_to_reject"],
}


async def connect(p2p: Any, peer_id: Any, maddrs: Iterable[Any]) -> None:
    """Dials ``peer_id`` at ``maddrs`` (multiaddrs without ``/p2p/``) from ``p2p``'s daemon: hivemind's ``P2P``
    dials only through its DHT or when a stream opens, at addresses the daemon already knows."""
    await p2p._client.connect(peer_id, list(maddrs))


def set_frame_reader(reader: Callable) -> None:
    """Makes every hivemind stream of this process read its frames with ``reader`` (``P2P.receive_raw_data``, a
    static method hivemind's stream handlers call; its own reads any length a peer declares)."""
    from hivemind.p2p import P2P

    P2P.receive_raw_data = staticmethod(reader)


def add_reachability_mode(name: str, flags: dict) -> None:
    """Teaches ``P2P.create(force_reachability=name)`` to start p2pd with ``flags`` (hivemind offers only
    "public" and "private"; relaying needs other p2pd flags). Idempotent."""
    from hivemind.p2p import P2P

    P2P.FORCE_REACHABILITY_MAPPING.setdefault(name, dict(flags))


def use_dht_storage(storage_class: type) -> None:
    """Makes DHT nodes started from now on in this process keep records in ``storage_class`` (hivemind's protocol
    looks its ``DHTLocalStorage`` up in its module when a node starts, and has no option for it)."""
    import hivemind.dht.protocol as protocol

    protocol.DHTLocalStorage = storage_class


def request_and_record_checkers(node: Any) -> list:
    """The objects a running DHT node checks requests and records with: its authorizer and each of its record
    validators (CompositeValidator keeps them in a private list)."""
    validators = list(getattr(node.protocol.record_validator, "_validators", ()))
    return [getattr(node.protocol, "authorizer", None), *validators]


def send_whole_messages(dht: Any) -> None:
    """In our process, once the DHT is created: its end of the pipe to the DHT process sends one message at a
    time. hivemind's DHT methods send on it from whichever thread calls them, and Python writes a message over
    16 KiB as a header and then the body: a send from another thread between the two interleaved its bytes,
    the DHT process read a corrupt message and died (two threads storing 1 MiB values did it at once)."""
    pipe = getattr(dht, "_outer_pipe", None)  # (a stand-in DHT of the tests has none)
    if pipe is not None:
        dht._outer_pipe = _OneSenderAtATime(pipe)


class _OneSenderAtATime:
    """A pipe end whose :meth:`send` holds a lock (see :func:`send_whole_messages`); the rest is the wrapped
    connection's."""

    def __init__(self, connection: Any):
        import threading

        self._connection, self._lock = connection, threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)

    def send(self, obj: Any) -> None:
        with self._lock:
            self._connection.send(obj)


class _WholeMessages:
    """A pipe end whose :meth:`recv` waits for the rest of a message that has begun to arrive (see
    :func:`read_whole_messages`); everything else is the wrapped connection's."""

    def __init__(self, connection: Any):
        self._connection = connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connection, name)

    def recv(self) -> Any:
        import os

        fd = self._connection.fileno()
        was = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            return self._connection.recv()
        finally:
            os.set_blocking(fd, was)


def read_whole_messages(dht: Any) -> None:
    """In the DHT process, before its loop starts: its end of the pipe from our process reads whole messages.
    hivemind's loop reads that pipe without blocking once some bytes arrived, and Python writes a message over
    16 KiB in two writes: a read between them raised ``BlockingIOError``, desynced the pipe and killed the DHT
    process (a 61 KiB store under load). The loop reads only after its poll says bytes are there, so waiting for
    the rest of the message is short."""
    dht._inner_pipe = _WholeMessages(dht._inner_pipe)
