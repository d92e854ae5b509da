"""Every use of hivemind 1.1.12's private API, in one place: what a hivemind upgrade must be checked against.

Each function below wraps one private attribute and says why no public API serves; ``PRIVATE`` lists them all.
``IN_SUBCLASSES`` lists what our subclasses of hivemind's classes override of their private methods or use of
their undocumented state, and why. tests/test_hivemind_internals.py checks that each name still exists, and that
no other module of peer/ or bootstrap/ touches a private name of hivemind's that these do not list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

PRIVATE = {  # module: the private names the functions below use
    "hivemind.dht.dht": ["DHT._inner_pipe", "DHT._outer_pipe", "DHT.kwargs"],
    "hivemind.p2p.p2p_daemon": ["P2P._client", "P2P.receive_raw_data", "P2P.FORCE_REACHABILITY_MAPPING"],
    "hivemind.dht.protocol": ["DHTLocalStorage", "DHTProtocol.record_validator", "DHTProtocol.authorizer",
                              "DHTProtocol.rpc_store"],
    "hivemind.dht.validation": ["CompositeValidator._validators"],
    "hivemind.utils.crypto": ["RSAPrivateKey._private_key", "RSAPublicKey._public_key"],
    "hivemind.dht.storage": ["DHTLocalStorage._remove_outdated"],
    "hivemind.p2p.servicer": ["ServicerBase._get_handle_name"],
    "hivemind.p2p.p2p_daemon_bindings.control": ["ControlClient._handle_persistent_request",
                                                 "ControlClient._handler_tasks"],
}
IN_SUBCLASSES = {  # module: what our subclasses override of a hivemind class or read and write of its state
    # peer/net/round/matchmaking.py's _Matchmaking overrides how a leader vets a join request (to refuse stale,
    # absurd or unplannable ones; it sets ``target_group_size`` to assemble once the expected peers joined), how
    # a follower asks a leader (a stream the leader closed is a failed request, not the end of the search), and
    # assembles between join requests once the expected peers are in (as hivemind's own join handler does: under
    # ``lock_request_join_group``, while leading, before ``assembled_group`` is set; ``min_group_size``, the
    # quorum after which a late peer's allowance runs). As a follower it declines a group the leader assembled that
    # is not ours by our own count (``follower_assemble_group`` returns None, as hivemind's own path does for a
    # disbanded group, and ends the search with an exception in ``assembled_group``, as hivemind's own errors do).
    "hivemind.averaging.matchmaking": ["Matchmaking._check_reasons_to_reject", "Matchmaking._request_join_group",
                                       "Matchmaking.target_group_size", "Matchmaking.current_followers",
                                       "Matchmaking.request_timeout", "Matchmaking.peer_id",
                                       "Matchmaking.client_mode", "Matchmaking.current_leader",
                                       "Matchmaking.lock_request_join_group", "Matchmaking.assembled_group",
                                       "Matchmaking.follower_assemble_group", "Matchmaking.min_group_size"],
    # peer/net/plumbing/dht_storage.py's BoundedStorage counts the bytes of the records it keeps: it reads the
    # stored entries, once the expired ones are dropped (:func:`drop_expired`).
    "hivemind.dht.storage": ["DHTLocalStorage.data"],
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


def handle_name(servicer: Any, method: str) -> str:
    """The name under which ``servicer``'s ``add_p2p_handlers`` registers ``method`` (no namespace): what a
    stream to that method is opened with when not through hivemind's stub (hivemind names it; no public API)."""
    return servicer._get_handle_name(None, method)


def add_reachability_mode(name: str, flags: dict) -> None:
    """Teaches ``P2P.create(force_reachability=name)`` to start p2pd with ``flags`` (hivemind offers only
    "public" and "private"; relaying needs other p2pd flags). Idempotent."""
    from hivemind.p2p import P2P

    P2P.FORCE_REACHABILITY_MAPPING.setdefault(name, dict(flags))


def around_dht_stores(wrap: Callable[[Callable], Callable]) -> None:
    """Makes DHT nodes started from now on in this process serve other nodes' store requests with
    ``wrap(hivemind's handler)``, a coroutine function of ``(protocol, request, context)``: the storage it calls
    is not told who asked (``context.remote_id``), and hivemind has no hook for it. Once per process."""
    from hivemind.dht.protocol import DHTProtocol

    if not getattr(DHTProtocol.rpc_store, "_wrapped", False):
        wrapped = wrap(DHTProtocol.rpc_store)
        setattr(wrapped, "_wrapped", True)
        setattr(DHTProtocol, "rpc_store", wrapped)


def use_dht_storage(storage_class: type) -> None:
    """Makes DHT nodes started from now on in this process keep records in ``storage_class`` (hivemind's protocol
    looks its ``DHTLocalStorage`` up in its module when a node starts, and has no option for it)."""
    import hivemind.dht.protocol as protocol

    protocol.DHTLocalStorage = storage_class


def private_key_from_der(der: bytes) -> RSAPrivateKey:
    """hivemind's RSAPrivateKey around a DER (TraditionalOpenSSL) key, as its pickling restores one (it has no
    constructor from bytes; its pickled state names its private ``_private_key``)."""
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def public_key_der(public_key: RSAPublicKey) -> bytes:
    """The DER (SubjectPublicKeyInfo) encoding of hivemind's RSAPublicKey, the bytes a libp2p peer id hashes
    (hivemind's ``to_bytes`` gives the OpenSSH encoding; the key it wraps is private)."""
    from cryptography.hazmat.primitives import serialization

    return public_key._public_key.public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)


def drop_expired(storage: Any) -> None:
    """Drops the expired entries of hivemind's ``TimedStorage`` (a ``DHTLocalStorage``) from its ``data``, as its
    own reads do first (it offers no public way to do only that)."""
    storage._remove_outdated()


def dht_kwargs(dht: Any) -> dict:
    """The keyword arguments a ``hivemind.DHT`` was created with, which its process hands its DHT node and P2P
    (it keeps them in an undocumented attribute)."""
    return dht.kwargs


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


def forget_ended_handlers() -> None:
    """Makes hivemind's daemon clients of this process, and of the processes it forks from now on, forget each
    handler of a request from another peer once it ends, however it ends. hivemind forgets one only once it
    answered, so a handler cancelled (its caller gave up, and the daemon said so) stayed in the client's table for
    good with its traceback, which holds the request's frames and bytes (up to 4 MiB each): any peer that gives up
    on its calls grew the node's process without bound (honest DHT processes to 2.5 GiB under a flood). hivemind
    has no option for it; this wraps ``ControlClient._handle_persistent_request`` to drop the table's entry
    (``_handler_tasks``) when the handler ends. Idempotent."""
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    handle = ControlClient._handle_persistent_request
    if getattr(handle, "_forgets", False):
        return

    async def handle_and_forget(self: Any, call_id: Any, request: Any) -> None:
        try:
            await handle(self, call_id, request)
        finally:
            self._handler_tasks.pop(call_id, None)

    setattr(handle_and_forget, "_forgets", True)
    setattr(ControlClient, "_handle_persistent_request", handle_and_forget)
