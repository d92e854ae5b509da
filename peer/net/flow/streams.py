"""What one remote peer can make this peer hold: frames, streams, and how long each stream lives.

Every protocol of ours (``rpc_reduce``, ``rpc_download``, ``rpc_join_group``) is a hivemind stream of
length-prefixed protobuf frames that any peer can open. Three bounds keep a hostile peer from exhausting an honest
one (bound every size before allocating it, give every wait a deadline, bound what one remote peer can consume):

- **Frame size**: :func:`cap_frame_size` replaces hivemind's ``P2P.receive_raw_data``, once per process, with a
  reader that refuses a frame larger than the run's largest message before reading its body.
- **Streams**: :class:`StreamGuard` admits at most ``per_peer`` concurrent streams from one remote peer,
  ``per_host`` from the peers of one host (:class:`HostBook`: fresh identities share their host's) and ``total``,
  of which ``reserved`` only for our partners (peers we were in a group with): strangers cannot take them all.
- **Stream lifetime**: every admitted stream's task is cancelled at its deadline, whatever it is waiting for.

Handlers read their request as a stream with a deadline (:func:`single_request`, :func:`first_message`); a caller
whose requests outlive the answer opens its stream with :func:`open_stream`. See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Optional, TypeVar

from hivemind.p2p import P2P, P2PHandlerError, PeerID

from peer.net.plumbing.hivemind_internals import set_frame_reader

log = logging.getLogger(__name__)

FRAME_OVERHEAD = 64 << 10  # protobuf headers, group ids, contributor lists: far below this
MIN_FRAME_LIMIT = 1 << 20  # matchmaking and error messages never need more

_frame_limit = 64 << 20  # until cap_frame_size is called: hivemind's own messages are far smaller


class FrameTooLarge(asyncio.IncompleteReadError):
    """A frame declared more bytes than the run's largest message. (An ``IncompleteReadError``: hivemind's
    stream readers end the stream quietly on it, as on a closed connection.)"""

    def __init__(self, declared: int, limit: int):
        super().__init__(b"", declared)
        self.args = (f"a frame declared {declared} bytes (limit {limit})",)


def frame_limit_for(chunk_bytes: int) -> int:
    """The largest frame a peer of a run with ``swarm.chunk_bytes`` sends (its pieces and state chunks carry
    at most ``chunk_bytes`` of payload), with headroom for headers."""
    return max(MIN_FRAME_LIMIT, chunk_bytes) + FRAME_OVERHEAD


async def _bounded_receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(P2P.HEADER_LEN)
    declared = int.from_bytes(header, P2P.BYTEORDER)
    if declared > _frame_limit:
        log.warning("refused a stream frame declaring %d bytes (limit %d); the stream is closed", declared,
                    _frame_limit)
        raise FrameTooLarge(declared, _frame_limit)
    return await reader.readexactly(declared)


def cap_frame_size(limit: int) -> None:
    """Makes every hivemind stream reader of this process refuse frames over ``limit`` bytes (in both
    directions: requests we serve and responses we read). Must be called before the P2P streams are used;
    calling it again sets a new limit."""
    global _frame_limit
    _frame_limit = int(limit)
    set_frame_reader(_bounded_receive_raw_data)


UNRESOLVED = "(unresolved)"  # the host key of peers whose connection the daemon has not listed to us yet
MAX_HOSTS_KNOWN = 4096  # peers whose host is remembered
HOST_LISTING_PERIOD = 0.5  # seconds between two listings of the daemon's connections


def host_key(addrs: Iterable[str]) -> Optional[str]:
    """The host a connection comes from, as per-host budgets count it: the IPv4 address, or the /64 of an IPv6
    one (one home gets a whole /64). None where the budget does not apply: a relayed connection (its address is
    the relay's, shared by every peer behind it) or loopback (several peers of one machine)."""
    for addr in addrs:
        if "/p2p-circuit" in addr:
            return None
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return None if parts[2].startswith("127.") else parts[2]
        if len(parts) > 2 and parts[1] == "ip6":
            if parts[2] in ("::1", "0:0:0:0:0:0:0:1"):
                return None
            groups = (parts[2].split("::")[0].split(":") + ["0"] * 4)[:4]
            return ":".join(groups) + "::/64"
    return None


class HostBook:
    """Which host each remote peer connects from (:func:`host_key`), as the P2P daemon lists its connections
    (:meth:`learn`). A peer not listed yet is :data:`UNRESOLVED`: such peers share one budget until the next
    listing, so fresh identities gain nothing by being fresh. Used from one event loop only (the handlers' that
    read it): written by :meth:`learn`, from the listing that :meth:`list_soon` starts there."""

    def __init__(self) -> None:
        self._hosts: dict[str, Optional[str]] = {}
        self._listing: tuple[float, Optional[asyncio.Task]] = (float("-inf"), None)

    def host(self, peer: str) -> Optional[str]:
        return self._hosts.get(peer, UNRESOLVED)

    def learn(self, connections: Iterable[tuple[str, list[str]]]) -> None:
        """Replaces what is known with the daemon's list of open connections, (peer id, its addresses)."""
        hosts = {peer: host_key(addrs) for peer, addrs in connections}
        self._hosts = dict(list(hosts.items())[:MAX_HOSTS_KNOWN])

    def list_soon(self, p2p: P2P, timeout: float) -> None:
        """Has the book learn ``p2p``'s daemon's open connections soon (a peer not listed yet came): one listing at a
        time, at most one per :data:`HOST_LISTING_PERIOD`, each within ``timeout``; a task of the running event loop,
        which owns it. Must be called in the event loop that owns ``p2p``."""
        started, task = self._listing
        if (task is None or task.done()) and time.monotonic() - started >= HOST_LISTING_PERIOD:
            self._listing = (time.monotonic(), asyncio.get_running_loop().create_task(self.list_now(p2p, timeout)))

    async def list_now(self, p2p: P2P, timeout: float) -> None:
        """Learns ``p2p``'s daemon's open connections, within ``timeout`` (a listing that fails changes nothing)."""
        try:
            infos = await asyncio.wait_for(p2p.list_peers(), timeout)
        except Exception as e:  # (a slow daemon: the peers stay unresolved, sharing one budget, until the next)
            log.debug("could not list the daemon's connections: %s: %s", type(e).__name__, e)
            return
        self.learn((str(info.peer_id), [str(a) for a in info.addrs]) for info in infos)


class StreamGuard:
    """Counts the streams each remote peer holds open in our handlers and bounds them: ``per_peer`` from one
    peer, ``per_host`` from the peers of one host (with ``hosts``; :class:`HostBook`), ``total`` in all, of which
    strangers (not ``partner(peer)`` when their stream opens) hold at most ``total - reserved``.

    Used from the event loop that runs the handlers (no locking needed). One guard is shared by all the
    handlers of a peer, so the bounds hold across protocols. ``resolve`` is called (in that loop) when a peer's
    host is not known yet: it should have ``hosts`` learn the daemon's connections soon.
    """

    def __init__(self, *, per_peer: int, total: int, admitted: Callable[[str], bool] = lambda peer: True,
                 per_host: Optional[int] = None, hosts: Optional[HostBook] = None,
                 resolve: Callable[[], None] = lambda: None, partner: Callable[[str], bool] = lambda peer: False,
                 reserved: int = 0):
        """``admitted``: whether a remote peer may use our handlers at all (authenticated runs: it holds a
        valid pass, ``auth.Admission``). ``partner``: whether we averaged with a peer lately (``Roster.partnered``);
        ``reserved`` streams of ``total`` are kept for those."""
        if not 0 <= reserved < total:
            raise ValueError(f"reserved streams must be in [0, {total}), got {reserved}")
        self.per_peer, self.total, self.per_host = per_peer, total, per_host
        self.admitted, self.partner, self.reserved = admitted, partner, reserved
        self.hosts, self.resolve = hosts, resolve
        self.open: Counter[str] = Counter()
        self.open_strangers = 0  # of the open streams, those admitted while their peer was no partner
        self.refused = 0  # streams refused since start (for logs and tests)
        self.unadmitted = 0  # ... of which from peers without a valid pass

    @property
    def open_total(self) -> int:
        return sum(self.open.values())

    def open_from_host(self, host: str) -> int:
        """Streams open from the peers of ``host`` (a :class:`HostBook` key)."""
        assert self.hosts is not None, "Must be called on a guard with a HostBook"
        return sum(n for peer, n in self.open.items() if self.hosts.host(peer) == host)

    def _refusal(self, peer: str, stranger: bool) -> Optional[str]:
        if self.open[peer] >= self.per_peer or self.open_total >= self.total:
            return "too many open streams from this peer"
        if stranger and self.open_strangers >= self.total - self.reserved:
            return "too many open streams from peers this peer has not averaged with"
        if self.hosts is not None and self.per_host is not None:
            host = self.hosts.host(peer)
            if host == UNRESOLVED:
                self.resolve()
            if host is not None and self.open_from_host(host) >= self.per_host:
                return "too many open streams from this peer's host"
        return None

    @contextlib.contextmanager
    def admit(self, peer: str, timeout: float) -> Iterator[Optional[str]]:
        """Yields None if a stream from ``peer`` may proceed, else why it is refused (one line for the peer).
        If it may, it is counted until the block exits, and the task running the block is cancelled after
        ``timeout`` seconds. Must be entered inside the task that serves the stream (hivemind runs each handler
        in its own task)."""
        if not self.admitted(peer):
            self.refused += 1
            self.unadmitted += 1
            if self.unadmitted in (1, 10, 100) or self.unadmitted % 1000 == 0:
                log.warning("refused a stream from %s: it holds no valid pass for this run; %d refused so far",
                            peer[-8:], self.unadmitted)
            yield "this run admits only peers with a valid pass"
            return
        stranger = not self.partner(peer)
        refusal = self._refusal(peer, stranger)
        if refusal is not None:
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("refused a stream from %s: %s (%d open from it, %d in all; limits %d, %d, %s per host); "
                            "%d refused so far", peer[-8:], refusal, self.open[peer], self.open_total, self.per_peer,
                            self.total, self.per_host, self.refused)
            yield refusal
            return
        task = asyncio.current_task()
        watchdog = asyncio.get_running_loop().call_later(timeout, task.cancel) if task is not None else None
        self.open[peer] += 1
        self.open_strangers += stranger
        try:
            yield None
        finally:
            if watchdog is not None:
                watchdog.cancel()
            self.open[peer] -= 1
            self.open_strangers -= stranger
            if self.open[peer] <= 0:
                del self.open[peer]


T = TypeVar("T")
REFUSAL_DRAIN_S = 0.5  # how long a refused stream may still deliver its end (an honest one's is already sent)


async def first_message(requests: AsyncIterator[T], timeout: float) -> T:
    """The first message of a request stream, within ``timeout`` seconds. Raises ``asyncio.TimeoutError``,
    or ``StopAsyncIteration`` if the stream ended without one."""
    return await asyncio.wait_for(requests.__anext__(), timeout=timeout)


async def single_request(requests: AsyncIterator[T], timeout: float) -> T:
    """The one request of a request-response stream and the requester's end of stream after it, within
    ``timeout`` seconds (hivemind's unary input, with a deadline). Reading to the end matters: closing our
    side while the requester's end of stream is unread resets the stream in the daemons, and the requester
    gets ``BrokenPipeError`` instead of our answer. Raises ``asyncio.TimeoutError``, ``StopAsyncIteration``
    (no request) or ``ValueError`` (more than one)."""
    async with asyncio.timeout(timeout):
        request = await requests.__anext__()
        async for _ in requests:
            raise ValueError("more than one request in a request-response stream")
    return request


async def drain(requests: AsyncIterator, timeout: float = REFUSAL_DRAIN_S) -> None:
    """Reads a refused stream to its end for at most ``timeout`` seconds before we answer and close (see
    :func:`single_request`); whatever it sends is dropped."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout):
            async for _ in requests:
                pass


class ResponseStream:
    """The responses of a stream we opened (:func:`open_stream`), which end when the handler's side closes. Our
    requests are written by a task of this stream's: :meth:`aclose` (which the caller must call, also when it
    never read) stops it and closes our side."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, requests: AsyncIterator[Any],
                 response_type: type, name: str):
        self._reader, self._writer, self._type, self._name = reader, writer, response_type, name
        self._writing = asyncio.ensure_future(self._write(requests))
        self._writing.add_done_callback(lambda task: task.cancelled() or task.exception())  # (retrieved: a
        # broken connection is read as the stream's end)

    async def _write(self, requests: AsyncIterator[Any]) -> None:
        async for request in requests:
            await P2P.send_protobuf(request, self._writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, self._writer)

    def __aiter__(self) -> "ResponseStream":
        return self

    async def __anext__(self) -> Any:
        try:
            response, error = await P2P.receive_protobuf(self._type, self._reader)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
            # the handler's side closed, or the connection did: read as the stream's end whichever the reader saw
            # first (our writer's failed write to a closed stream also ends the reader, with BrokenPipeError)
            raise StopAsyncIteration from None
        if error is not None:
            raise P2PHandlerError(f"handler {self._name} failed: {error.message}")
        return response

    async def aclose(self) -> None:
        self._writing.cancel()
        self._writer.close()


async def open_stream(p2p: P2P, peer: PeerID, name: str, requests: AsyncIterator[Any],
                      response_type: type) -> ResponseStream:
    """Opens a stream to handler ``name`` at ``peer`` and sends ``requests`` on it, as hivemind's
    ``P2P.iterate_protobuf_handler`` does, except that the responses end as soon as the handler's side closes:
    hivemind's end only once our requests have, and a member's requests to a reducer end only after its average
    came, so a reducer that closed without a word (or whose last word the daemons dropped) held the member to
    the round's deadline. Raises what opening the stream raises (hivemind's ``ControlFailure`` for a peer that
    cannot be dialed)."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, name)
    return ResponseStream(reader, writer, requests, response_type, name)
