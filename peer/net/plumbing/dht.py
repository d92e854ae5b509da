"""The one place that creates a hivemind DHT (:func:`create_dht`), for both the peer daemon and the bootstrap node.

Network-safety invariant: the swarm never talks to anything outside itself. Enforced here:

* ``nat_port_map`` is off unless the operator opts in (``--nat-port-map``): it sends UPnP and NAT-PMP discovery.
* ``check_if_identity_free=False`` always: hivemind's identity check spawns a throw-away ``P2P`` with the default
  ``nat_port_map=True``, which would send those packets anyway.
* ``use_ipfs=False`` always (it bootstraps to the public IPFS DHT); p2pd's ``-b`` without peers also falls back to
  IPFS bootstrap nodes, and hivemind passes it only with ``initial_peers``.
* ``auto_nat`` / ``use_relay`` keep hivemind's defaults (on): they only talk to peers we are already connected to.
* Circuit relaying is opt-in and names its relays (:func:`relay_options`; docs/architecture.md, "Peers behind
  NAT"): ``relay_via`` reserves only on the named nodes; ``relay_service`` relays with p2pd's configured limits.

hivemind is imported lazily so that ``import peer.net.plumbing.dht`` stays cheap (hivemind imports torch).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from peer.errors import JoinError
from peer.net.plumbing.addresses import _check_maddrs, check_maddrs, ensure_identity

if TYPE_CHECKING:  # pragma: no cover
    import hivemind

log = logging.getLogger(__name__)
_UNSPECIFIED_HOSTS = {("ip4", "0.0.0.0"), ("ip6", "::")}
# Backoff between two tries to reach the initial peers: doubling from the first to the last (seconds).
JOIN_RETRY_FIRST, JOIN_RETRY_MAX = 1.0, 15.0
# p2pd's words when none of its bootstrap peers could be connected to.
_BOOTSTRAP_FAILED = "failed to connect to bootstrap peers"
# sent to a DHT process that did not become ready in time: it prints every thread's stack (faulthandler) to the
# stderr it shares with our process, so that the log says where a start hung
STACKS_SIGNAL = signal.SIGUSR1

# hivemind's P2P.create(force_reachability=...) picks p2pd flags by name; two names of ours are taught to it in
# the DHT process (_register_relay_modes, through hivemind_internals). STATIC_RELAYS also turns relay discovery
# off: p2pd then uses ``trusted_relays`` as libp2p's *static* relays and reserves at once. With discovery on
# (hivemind's only other choice) libp2p's autorelay waits for 4 candidates or its 3-minute boot delay before its
# first reservation.
STATIC_RELAYS = "private, static relays"
# RELAY_SERVICE: reachability public at start, so p2pd's configured relay service starts at once. p2pd also
# registers libp2p's relay service with the *default* limits (128 KiB per relayed connection), racing with the
# configured one for the relay protocol: whichever registers last serves every reservation and circuit. With
# GOMAXPROCS=1 (Go on one thread) p2pd's main goroutine registers the default one first and the configured one
# comes last: 24 of 24 lab starts, against 8 of 12 with Go's default (docs/architecture.md, "Peers behind NAT").
RELAY_SERVICE = "public, relay service"
_RELAY_MODES = {STATIC_RELAYS: {"forceReachabilityPrivate": 1, "relayDiscovery": 0},
                RELAY_SERVICE: {"forceReachabilityPublic": 1}}


def create_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    identity_path: str | None,
    client_mode: bool,
    nat_port_map: bool = False,
    relay_via: Sequence[str] = (),
    relay_service: bool = False,
    record_validators: Iterable = (),
    startup_timeout: float = 30.0,
    wait_timeout: float = 5.0,
    join_timeout: float = 0.0,
    stop: Optional[threading.Event] = None,
    **dht_kwargs,
) -> "hivemind.DHT":
    """Validate the addresses, then start a ``hivemind.DHT`` (background process + p2pd) and wait for it.

    ``relay_via``: ``/p2p/`` multiaddrs of public nodes to be dialable through (libp2p circuit relay v2): this
    node declares itself behind a NAT (reachability private), reserves a slot on each of them at once and
    advertises ``.../p2p/RELAY/p2p-circuit`` addresses. ``relay_service``: this node is public and relays for
    others with p2pd's configured limits (see the module docstring). Neither goes with the other, nor
    ``relay_via`` with ``client_mode``.

    If none of ``initial_peers`` can be reached, tries again with a doubling backoff for ``join_timeout``
    seconds (a bootstrap node that is restarting, a network that comes up a moment later), then raises
    :class:`JoinError` naming each address and why it failed (refused, no answer, another peer id there).
    A set ``stop`` event ends the retries early (a :class:`JoinError` without the diagnosis).
    Raises ``ValueError`` with a one-line, flag-naming message for bad input; ``RuntimeError`` if the node
    does not come up for another reason. Nothing is left running after an error.
    ``dht_kwargs`` go to ``hivemind.DHT`` (e.g. ``num_workers``); the network-safety options cannot be overridden.
    """
    deadline, delay = time.monotonic() + join_timeout, JOIN_RETRY_FIRST
    while True:
        try:
            return _start_dht(initial_peers=initial_peers, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
                              identity_path=identity_path, client_mode=client_mode, nat_port_map=nat_port_map,
                              relay_via=relay_via, relay_service=relay_service,
                              record_validators=record_validators, startup_timeout=startup_timeout,
                              wait_timeout=wait_timeout, **dht_kwargs)
        except RuntimeError as e:
            if not initial_peers or _BOOTSTRAP_FAILED not in str(e):
                raise
            if stop is not None and stop.is_set():
                raise JoinError("stopped before any initial peer answered") from None
            if time.monotonic() + delay > deadline:
                from peer.net.plumbing.reachability import diagnose_initial_peers

                why = "; ".join(diagnose_initial_peers(initial_peers, host_maddrs, timeout=wait_timeout))
                raise JoinError(f"could not reach any initial peer within {join_timeout:g} s (swarm.join_timeout): "
                                f"{why}") from None
            log.warning("none of the %d initial peer(s) answered; trying again in %.0f s", len(initial_peers), delay)
            if stop is not None and stop.wait(delay):
                raise JoinError("stopped before any initial peer answered") from None
            if stop is None:
                time.sleep(delay)
            delay = min(2 * delay, JOIN_RETRY_MAX)


def _start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    identity_path: str | None,
    client_mode: bool,
    nat_port_map: bool,
    relay_via: Sequence[str],
    relay_service: bool,
    record_validators: Iterable,
    startup_timeout: float,
    wait_timeout: float,
    **dht_kwargs,
) -> "hivemind.DHT":
    """One try of :func:`create_dht` (no retries)."""
    initial_peers, host_maddrs, announce_maddrs = check_maddrs(
        initial_peers=initial_peers, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs)
    forbidden = {"nat_port_map", "check_if_identity_free", "use_ipfs", "start", "use_auto_relay", "trusted_relays",
                 "force_reachability"} & set(dht_kwargs)
    if forbidden:
        raise TypeError(f"create_dht: {sorted(forbidden)} cannot be overridden")
    dht_kwargs.update(relay_options(relay_via, relay_service=relay_service, client_mode=client_mode))
    if identity_path is not None:
        try:
            ensure_identity(identity_path)
        except OSError as e:
            raise ValueError(f"--identity-path: cannot create {str(identity_path)!r}: {e}") from e
        except ValueError as e:
            raise ValueError(f"--identity-path: {e}") from e
    from peer.net.plumbing.dht_storage import SizeGate

    record_validators = [SizeGate(), *record_validators]  # (an oversized record costs no validator's time)
    dht = None
    # p2pd start <= startup_timeout; bootstrap pings + neighbour search are bounded by ~2 * wait_timeout.
    ready_timeout = startup_timeout + 4 * wait_timeout + 10.0
    try:
        with _handled_signals_deferred():  # the DHT's first MPFuture starts torch_shm_manager; see below
            dht = _parent_bound_dht_class()(
                initial_peers=initial_peers or None,
                start=False,
                host_maddrs=host_maddrs,
                announce_maddrs=announce_maddrs or None,
                identity_path=None if identity_path is None else str(identity_path),
                client_mode=client_mode,
                nat_port_map=bool(nat_port_map),
                check_if_identity_free=False,
                use_ipfs=False,
                record_validators=record_validators,
                startup_timeout=startup_timeout,
                wait_timeout=wait_timeout,
                **dht_kwargs,
            )
        dht.run_in_background(await_ready=True, timeout=ready_timeout)
    except BaseException as e:
        if dht is not None and isinstance(e, TimeoutError) and dht.pid is not None and dht.is_alive():
            log.error("the DHT process did not become ready within %.0f s; its threads' stacks follow", ready_timeout)
            with contextlib.suppress(ProcessLookupError):  # (it may have just exited)
                os.kill(dht.pid, STACKS_SIGNAL)  # (it writes them to the stderr it shares with us, then is shut)
        if dht is not None:
            shutdown_dht(dht)
        if isinstance(e, TimeoutError):
            raise RuntimeError(f"DHT did not become ready within {ready_timeout:.0f} s") from e
        if isinstance(e, Exception) and not isinstance(e, (ValueError, RuntimeError)):
            raise RuntimeError(f"DHT failed to start: {type(e).__name__}: {e}") from e
        raise
    return dht


def relay_options(relay_via: Sequence[str], *, relay_service: bool, client_mode: bool) -> dict:
    """The ``hivemind.DHT`` (``P2P.create``) options of ``relay_via`` / ``relay_service`` (see :func:`create_dht`);
    ``ValueError`` names the flag."""
    relay_via = _check_maddrs("--relay-via", relay_via, need_peer=True)
    if relay_via and relay_service:
        raise ValueError("--relay-via: a node behind a NAT (--relay-via) cannot relay for others (--relay-service)")
    if relay_via and client_mode:
        raise ValueError("--relay-via: not with --client-mode (a client-mode peer is never dialed, relayed or not)")
    if relay_via:
        return dict(use_auto_relay=True, trusted_relays=relay_via, force_reachability=STATIC_RELAYS)
    if relay_service:
        return dict(force_reachability=RELAY_SERVICE)
    return {}


def _register_relay_modes(dht_kwargs: Optional[dict] = None) -> None:
    """In the process that runs ``P2P.create``: teaches it :data:`STATIC_RELAYS` and :data:`RELAY_SERVICE`, and
    runs a relay's p2pd with GOMAXPROCS=1 (see :data:`RELAY_SERVICE`)."""
    from peer.net.plumbing.hivemind_internals import add_reachability_mode

    for name, flags in _RELAY_MODES.items():
        add_reachability_mode(name, flags)
    if (dht_kwargs or {}).get("force_reachability") == RELAY_SERVICE:
        os.environ["GOMAXPROCS"] = "1"  # (P2P.create hands p2pd a copy of this process's environment)


_PARENT_BOUND_DHT = None


def _parent_bound_dht_class():
    """``hivemind.DHT`` whose background process dies with the process that started it.

    hivemind's DHT process (and its p2pd, which exits when its own parent dies) outlives a peer
    killed with SIGKILL: it would keep answering in the swarm for a dead peer. Linux's
    PR_SET_PDEATHSIG kills it with its parent; elsewhere this is a plain ``hivemind.DHT``.
    """
    global _PARENT_BOUND_DHT
    import hivemind

    from peer.net.plumbing import dht_storage  # (imported here, in the parent: the DHT process is forked)
    from peer.net.plumbing.hivemind_internals import (dht_kwargs, forget_ended_handlers, read_whole_messages,
                                                      send_whole_messages)

    forget_ended_handlers()  # (here, in the parent: the DHT process it forks and its own P2P clients inherit it)

    if _PARENT_BOUND_DHT is None or _PARENT_BOUND_DHT.__bases__[0] is not hivemind.DHT:  # (tests swap DHT)

        class ParentBoundDHT(hivemind.DHT):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self._creator_pid = os.getpid()  # read in the forked child
                send_whole_messages(self)  # (one sender at a time: our threads all call the DHT)

            def run(self) -> None:
                faulthandler.register(STACKS_SIGNAL, all_threads=True)  # (see _start_dht: a start that hangs)
                _die_with_parent(self._creator_pid)
                _register_relay_modes(dht_kwargs(self))
                dht_storage.install()  # (what the node keeps for others is bounded: peer/net/plumbing/dht_storage.py)
                read_whole_messages(self)  # (whole messages from our process, however large)
                super().run()

        _PARENT_BOUND_DHT = ParentBoundDHT
    return _PARENT_BOUND_DHT


def _die_with_parent(parent_pid: int) -> None:
    """In a forked child: ask the kernel for SIGKILL when the parent dies (Linux; no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


@contextlib.contextmanager
def _handled_signals_deferred():
    """Hold back (in this thread) the signals that have a Python handler, e.g. SIGINT/SIGTERM, until exit.

    torch's libshm starts ``torch_shm_manager`` on the first shared-memory tensor of a process (hivemind's
    MPFuture makes one) and reads its handle with ``read()`` wrapped in a retry-on-EINTR macro that retries a
    stored result: a signal caught by a Python handler at that moment makes the process spin at 100% CPU
    forever. Deferring the signal for the duration avoids it; it is delivered on exit from this block.
    """
    handled = {s for s in signal.valid_signals() if callable(signal.getsignal(s))}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _children(ppid: int) -> list[tuple[int, str]]:
    """(pid, starttime) of live processes whose parent is ``ppid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == ppid and fields[0] != "Z":
            out.append((int(entry), fields[19]))
    return out


def _alive(pid: int, starttime: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == starttime and fields[0] != "Z"


def shutdown_dht(dht: "hivemind.DHT", timeout: float = 10.0) -> None:
    """Shut a DHT down and make sure its p2pd is gone too.

    ``hivemind.DHT.shutdown`` falls back to SIGTERM on the DHT process after a grace period, which
    orphans p2pd; so remember the DHT process's children first and kill any that outlive it.
    """
    pid = dht.pid
    children = _children(pid) if pid is not None and dht.is_alive() else []
    try:
        dht.shutdown()
    finally:
        deadline = time.monotonic() + timeout
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = [c for c in children if _alive(*c)]
            for child_pid, _ in left:
                try:
                    os.kill(child_pid, sig)
                except ProcessLookupError:
                    pass
            while left and time.monotonic() < deadline:
                time.sleep(0.05)
                left = [c for c in left if _alive(*c)]
            if not left:
                break
            deadline = time.monotonic() + 2.0


def visible_maddrs(dht: "hivemind.DHT") -> list[str]:
    """This node's reachable multiaddrs (with ``/p2p/<id>``), minus unspecified hosts (0.0.0.0, ::)."""
    out: list[str] = []
    for maddr in dht.get_visible_maddrs(latest=True):
        names = [p.name for p in maddr.protocols()]
        if any((n, maddr.value_for_protocol(n)) in _UNSPECIFIED_HOSTS for n in ("ip4", "ip6") if n in names):
            continue
        if str(maddr) not in out:
            out.append(str(maddr))
    return out


async def _peer_counts(_dht, node) -> tuple[int, int]:
    routing_table = node.protocol.routing_table
    in_buckets = sum(len(bucket.nodes_to_peer_id) for bucket in routing_table.buckets)
    return in_buckets, len(await node.p2p.list_peers())


def peer_counts(dht: "hivemind.DHT", timeout: float = 10.0) -> tuple[int, int]:
    """(DHT peers in this node's routing table, open libp2p connections), asked inside the DHT process.

    Bounded by ``timeout``: a plain ``run_coroutine`` blocks forever if the DHT process has died.
    """
    return dht.run_coroutine(_peer_counts, return_future=True).result(timeout=timeout)


async def _reconnect(_dht, node, peers: dict[str, list[str]], timeout: float) -> int:
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from peer.net.plumbing.hivemind_internals import connect

    table = node.protocol.routing_table

    async def ping(peer_id: PeerID, maddrs: list[str]) -> None:
        if maddrs:  # dial the known addresses first: after a long outage libp2p may have forgotten them
            with contextlib.suppress(Exception):
                await connect(node.p2p, peer_id, [Multiaddr(m) for m in maddrs])
        await node.protocol.call_ping(peer_id)  # on an answer, each side adds the other to its table

    missing = {PeerID.from_base58(pid): maddrs for pid, maddrs in peers.items()}
    missing = {pid: maddrs for pid, maddrs in missing.items() if pid != node.peer_id and pid not in table}
    if missing:
        await asyncio.wait([asyncio.ensure_future(ping(pid, m)) for pid, m in missing.items()], timeout=timeout)
        if any(pid in table for pid in missing):  # back in touch: learn the rest of the swarm around us
            with contextlib.suppress(Exception):
                await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
    return sum(len(bucket.nodes_to_peer_id) for bucket in table.buckets)


def reconnect(dht: "hivemind.DHT", peers: dict[str, list[str]], timeout: float):
    """Pings ``peers`` ({peer id: multiaddrs, possibly none}) that are not in the DHT's routing table, from
    inside the DHT process, and refills the table around our own id if one answered. Returns an awaitable
    future of the routing table's size (done within about 2 x ``timeout``).

    A node drops every neighbour that fails to answer a request, so after its own link was down it may
    know no one; nobody contacts it either (they dropped it too), and it would stay alone until libp2p
    happens to redial. Call this while the node sees no other peer.
    """
    import functools

    return dht.run_coroutine(functools.partial(_reconnect, peers=peers, timeout=timeout), return_future=True)


def paste_line(dht: "hivemind.DHT") -> str:
    """The ready-to-paste line for other nodes: ``--initial-peers MADDR [MADDR ...]``."""
    return "--initial-peers " + " ".join(visible_maddrs(dht))
