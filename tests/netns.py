"""A throw-away network lab made of Linux network namespaces, for swarm tests and benchmarks.

``NetnsLab(n)`` creates one *bridge* namespace holding a Linux bridge, and ``n`` *host* namespaces,
each joined to the bridge by a veth pair: the host side is ``eth0`` with address ``10.77.0.(i+1)/24``
(host 0 is ``10.77.0.1``), the bridge side is ``vh<i>`` inside the bridge namespace. Loopback is up in
every host. Nothing is routed anywhere else: the host namespaces have only the connected /24 route and
the bridge namespace has no address at all, so traffic never leaves the lab and the machine's real
interfaces are never touched.

Processes run in host ``i`` through ``lab.run_args(i, [...])`` (``ip netns exec NAME ...``, which execs
the command in place: the pid, session and process group stay the ones ``Proc.start`` created, so
``Proc.kill_group`` still reaches them and their p2pd daemons).

Home routers: hosts listed in ``nat`` sit behind a router namespace of their own, as a home GPU does. The
router holds the lab address ``10.77.0.(i+1)`` on the bridge and masquerades the host's private network
``192.168.(i+1).0/24`` behind it (iptables ``MASQUERADE``; its ``FORWARD`` chain admits from outside only
replies to connections the host opened, and there is no port forward), so the host dials out and nobody can
dial in. ``addr(i)`` is then the host's private address, ``public_addr(i)`` the router's.

``count_packets(i, addr)`` starts counting what host i's home router forwards to or from ``addr``;
``packets(i, addr)`` reads the count (e.g. zero: two NAT'd hosts never exchanged a packet directly).

Addresses: ``SUBNET`` (10.77.0.0/24, private) by default. libp2p advertises a circuit-relay address only through
a relay with a public address (it drops a relay's private addresses), so a lab that relays uses ``PUBLIC_SUBNET``,
public-looking addresses that exist only inside the lab's namespaces as well (nothing routes out of the lab).

``shape(i, rate_mbit)`` puts a token-bucket filter (``tc ... tbf``) on both directions of host i's link:
egress of its ``eth0`` (upload) and egress of the bridge-side ``vh<i>`` (download). ``cut(i)`` /
``restore(i)`` take the link down/up (a "pulled cable"; the host keeps its address). ``partition(a, b)`` /
``heal()``: the hosts of ``a`` and of ``b`` drop each other's packets (iptables in each host), each still reaching
everyone else.

Every namespace name carries a per-run prefix ``swlab-<creator pid>-<random>-``; deleting the
namespaces deletes every veth and the bridge with them. :meth:`NetnsLab.close` (also on ``__exit__``)
is idempotent, and every new lab first removes namespaces left by a crashed earlier run: those whose
creator pid is no longer alive (a concurrent run's namespaces are left alone).

``netns_available()`` probes whether all of this is permitted here (root / CAP_NET_ADMIN, ``ip`` and
``tc`` present, veth, bridge and tbf supported) by building and deleting a tiny lab; tests skip with
its reason when it is not.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from helpers import Proc

FAMILY = "swlab"
SUBNET = "10.77.0"  # a private /24 that exists only inside the lab's namespaces
PUBLIC_SUBNET = "11.77.0"  # public-looking (libp2p relays advertise only public addresses); also lab-only
HOME_NET = "192.168"  # host i behind a home router: 192.168.(i+1).0/24
HOST_IF = "eth0"
BRIDGE_IF = "br0"
WAN_IF, LAN_IF = "wan0", "lan0"  # a home router's sides
_NAME_RE = re.compile(rf"^{FAMILY}-(\d+)-([0-9a-f]+)-")
CMD_TIMEOUT = 15.0  # seconds for one ip/tc command


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed (the message has the command and its stderr)."""


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise NetnsError(f"'{name}' (iproute2) is not installed")
    return path


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=CMD_TIMEOUT,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(map(str, args))}: timed out after {CMD_TIMEOUT:g} s") from None
    if check and res.returncode != 0:
        raise NetnsError(f"{' '.join(map(str, args))}: exit {res.returncode}: {res.stderr.strip()}")
    return res


def list_namespaces() -> list[str]:
    """Names of every network namespace known to ``ip netns`` (ids stripped)."""
    out = _run([_tool("ip"), "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Deletes lab namespaces whose creator process is gone (a crashed earlier run); returns their names."""
    removed = []
    for name in list_namespaces():
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            if _run([_tool("ip"), "netns", "delete", name], check=False).returncode == 0:
                removed.append(name)
    return removed


class NetnsLab:
    """``n_hosts`` namespaces on one bridge; see the module docstring. Use as a context manager."""

    def __init__(self, n_hosts: int, *, subnet: str = SUBNET, nat: Sequence[int] = ()):
        """``nat``: the hosts behind a home router of their own (see the module docstring)."""
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts must be in [1, 200] (got {n_hosts})")
        self.n_hosts = n_hosts
        self.subnet = subnet
        self.nat = frozenset(nat)
        if not all(0 <= i < n_hosts for i in self.nat):
            raise ValueError(f"nat hosts {sorted(self.nat)} not all in [0, {n_hosts})")
        self.prefix = f"{FAMILY}-{os.getpid()}-{secrets.token_hex(3)}-"
        self.bridge_ns = self.prefix + "br"
        self._ip, self._tc = _tool("ip"), _tool("tc")
        self._created: list[str] = []  # namespaces, in creation order
        self._shaped: dict[int, tuple[float, float, float]] = {}
        self._dropped: list[tuple[int, int]] = []  # (host, the host whose packets it drops): partition()

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "NetnsLab":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> "NetnsLab":
        """Builds the lab (removing a crashed run's leftovers first); on any failure it is torn down."""
        remove_leftovers()
        try:
            self._add_ns(self.bridge_ns)
            self._ipn(self.bridge_ns, "link", "add", BRIDGE_IF, "type", "bridge")
            self._ipn(self.bridge_ns, "link", "set", BRIDGE_IF, "up")
            for i in range(self.n_hosts):
                ns = self.host(i)
                self._add_ns(ns)
                self._ipn(ns, "link", "set", "lo", "up")
                # the namespace on the bridge: the host itself, or its home router
                public_ns, public_if = (self.router(i), WAN_IF) if i in self.nat else (ns, HOST_IF)
                if i in self.nat:
                    self._add_ns(public_ns)
                self._ipn(public_ns, "link", "add", public_if, "type", "veth", "peer", "name", self._bridge_if(i),
                          "netns", self.bridge_ns)
                self._ipn(self.bridge_ns, "link", "set", self._bridge_if(i), "master", BRIDGE_IF)
                self._ipn(self.bridge_ns, "link", "set", self._bridge_if(i), "up")
                self._ipn(public_ns, "addr", "add", f"{self.public_addr(i)}/24", "dev", public_if)
                self._ipn(public_ns, "link", "set", public_if, "up")
                if i in self.nat:
                    self._home_router(i)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Deletes every namespace this lab created (their veths and the bridge go with them). Idempotent."""
        errors = []
        for ns in reversed(self._created):
            res = _run([self._ip, "netns", "delete", ns], check=False)
            if res.returncode != 0 and ns in list_namespaces():
                errors.append(f"{ns}: {res.stderr.strip()}")
        self._created.clear()
        self._shaped.clear()
        if errors:
            raise NetnsError("could not delete namespaces: " + "; ".join(errors))

    def namespaces(self) -> list[str]:
        """Names of this lab's namespaces that currently exist."""
        return [ns for ns in list_namespaces() if ns.startswith(self.prefix)]

    # ---- addressing ------------------------------------------------------------------------
    def host(self, i: int) -> str:
        """Namespace name of host ``i``."""
        self._check(i)
        return f"{self.prefix}h{i}"

    def addr(self, i: int) -> str:
        """IPv4 address of host ``i``: ``10.77.0.(i+1)``, or behind a home router ``192.168.(i+1).2``."""
        self._check(i)
        return f"{HOME_NET}.{i + 1}.2" if i in self.nat else f"{self.subnet}.{i + 1}"

    def public_addr(self, i: int) -> str:
        """The address others see host ``i``'s connections come from: its own, or its router's."""
        self._check(i)
        return f"{self.subnet}.{i + 1}"

    def router(self, i: int) -> str:
        """Namespace name of host ``i``'s home router (hosts in ``nat`` only)."""
        if self._check(i) not in self.nat:
            raise ValueError(f"host {i} is not behind a home router")
        return f"{self.prefix}r{i}"

    def run_args(self, i: int, args: Sequence[str]) -> list[str]:
        """``args`` prefixed so that they run inside host ``i``'s namespace (same pid: exec in place)."""
        return [self._ip, "netns", "exec", self.host(i), *[str(a) for a in args]]

    # ---- link control ----------------------------------------------------------------------
    def shape(self, i: int, rate_mbit: float, *, burst_kb: float = 32, latency_ms: float = 100) -> None:
        """Limits host ``i``'s link to ``rate_mbit`` Mbit/s in each direction with a tbf (re-callable)."""
        if rate_mbit <= 0 or burst_kb <= 0 or latency_ms <= 0:
            raise ValueError("rate_mbit, burst_kb and latency_ms must be > 0")
        tbf = ["root", "tbf", "rate", f"{rate_mbit * 1000:.0f}kbit", "burst", f"{burst_kb:g}kb",
               "latency", f"{latency_ms:g}ms"]
        self._tcn(self.host(i), "qdisc", "replace", "dev", HOST_IF, *tbf)  # upload
        self._tcn(self.bridge_ns, "qdisc", "replace", "dev", self._bridge_if(i), *tbf)  # download
        self._shaped[i] = (rate_mbit, burst_kb, latency_ms)

    def unshape(self, i: int) -> None:
        """Removes host ``i``'s rate limit (both directions)."""
        self._check(i)
        if self._shaped.pop(i, None) is not None:
            _run([self._tc, "-n", self.host(i), "qdisc", "del", "dev", HOST_IF, "root"], check=False)
            _run([self._tc, "-n", self.bridge_ns, "qdisc", "del", "dev", self._bridge_if(i), "root"], check=False)

    def qdiscs(self, i: int) -> str:
        """``tc qdisc show`` of both ends of host ``i``'s link (for diagnostics)."""
        host = _run([self._tc, "-n", self.host(i), "-s", "qdisc", "show", "dev", HOST_IF], check=False).stdout
        br = _run([self._tc, "-n", self.bridge_ns, "-s", "qdisc", "show", "dev", self._bridge_if(i)],
                  check=False).stdout
        return f"host {i} {HOST_IF}:\n{host}bridge {self._bridge_if(i)}:\n{br}"

    def cut(self, i: int) -> None:
        """Takes host ``i``'s link down (the bridge-side end: the host keeps its address and routes)."""
        self._ipn(self.bridge_ns, "link", "set", self._bridge_if(self._check(i)), "down")

    def restore(self, i: int) -> None:
        """Brings host ``i``'s link back up after :meth:`cut`."""
        self._ipn(self.bridge_ns, "link", "set", self._bridge_if(self._check(i)), "up")

    def partition(self, side_a: Sequence[int], side_b: Sequence[int]) -> None:
        """Drops every packet between the hosts of ``side_a`` and those of ``side_b`` (each host's firewall drops
        what arrives from the other side, silently, as a broken route would); both sides still reach every other
        host. :meth:`heal` undoes it. Needs iptables (:func:`nat_available`)."""
        for a in side_a:
            for b in side_b:
                for i, j in ((a, b), (b, a)):
                    self._drop_from(i, j, "-I")
                    self._dropped.append((i, j))

    def heal(self) -> None:
        """Undoes every :meth:`partition`."""
        while self._dropped:
            self._drop_from(*self._dropped.pop(), "-D")

    def _drop_from(self, i: int, j: int, op: str) -> None:
        _run([self._ip, "netns", "exec", self.host(i), _tool("iptables"), op, "INPUT", "-s", self.public_addr(j),
              "-j", "DROP"])

    # ---- traffic counters (home routers) ------------------------------------------------------
    def count_packets(self, i: int, addr: str) -> None:
        """Counts the packets host ``i``'s home router forwards to or from ``addr`` from now on (:meth:`packets`)."""
        for side in ("-s", "-d"):
            _run([self._ip, "netns", "exec", self.router(i), _tool("iptables"), "-I", "FORWARD", "1", side, addr])

    def packets(self, i: int, addr: str) -> int:
        """Packets host ``i``'s home router forwarded to or from ``addr`` since :meth:`count_packets`."""
        rules = _run([self._ip, "netns", "exec", self.router(i), _tool("iptables"), "-v", "-S", "FORWARD"]).stdout
        counted = [line.split() for line in rules.splitlines()
                   if line.split()[2:4] in (["-s", f"{addr}/32"], ["-d", f"{addr}/32"])]
        if len(counted) != 2:
            raise NetnsError(f"no packet counters for {addr} in host {i}'s router (count_packets first):\n{rules}")
        return sum(int(words[words.index("-c") + 1]) for words in counted)

    # ---- internals -------------------------------------------------------------------------
    def _check(self, i: int) -> int:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host {i} not in [0, {self.n_hosts})")
        return i

    @staticmethod
    def _bridge_if(i: int) -> str:
        return f"vh{i}"

    def _home_router(self, i: int) -> None:
        """Puts host ``i`` behind its router: a private /24, the router as its default route, masquerade out,
        nothing in but replies."""
        host, router, lan = self.host(i), self.router(i), f"{HOME_NET}.{i + 1}"
        self._ipn(router, "link", "set", "lo", "up")
        self._ipn(host, "link", "add", HOST_IF, "type", "veth", "peer", "name", LAN_IF, "netns", router)
        self._ipn(router, "addr", "add", f"{lan}.1/24", "dev", LAN_IF)
        self._ipn(router, "link", "set", LAN_IF, "up")
        self._ipn(host, "addr", "add", f"{self.addr(i)}/24", "dev", HOST_IF)
        self._ipn(host, "link", "set", HOST_IF, "up")
        self._ipn(host, "route", "add", "default", "via", f"{lan}.1")
        iptables = _tool("iptables")
        for rule in (["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
                     [iptables, "-t", "nat", "-A", "POSTROUTING", "-o", WAN_IF, "-j", "MASQUERADE"],
                     [iptables, "-P", "FORWARD", "DROP"],
                     [iptables, "-A", "FORWARD", "-i", LAN_IF, "-o", WAN_IF, "-j", "ACCEPT"],
                     [iptables, "-A", "FORWARD", "-i", WAN_IF, "-o", LAN_IF, "-m", "conntrack", "--ctstate",
                      "ESTABLISHED,RELATED", "-j", "ACCEPT"]):
            _run([self._ip, "netns", "exec", router, *rule])

    def _add_ns(self, ns: str) -> None:
        _run([self._ip, "netns", "add", ns])
        self._created.append(ns)

    def _ipn(self, ns: str, *args: str) -> None:
        _run([self._ip, "-n", ns, *args])

    def _tcn(self, ns: str, *args: str) -> None:
        _run([self._tc, "-n", ns, *args])

    def __repr__(self) -> str:
        return f"NetnsLab(prefix={self.prefix!r}, hosts={self.n_hosts}, shaped={self._shaped})"


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """``(True, "")`` if namespaces, veth, a bridge and tbf can be created here, else ``(False, reason)``."""
    if not hasattr(os, "geteuid"):
        return False, "not a POSIX system"
    try:
        with NetnsLab(1) as lab:
            _run(lab.run_args(0, ["true"]))
            lab.shape(0, 10)
            lab.cut(0)
            lab.restore(0)
    except NetnsError as e:
        return False, f"network namespaces not permitted here: {e}"
    except OSError as e:
        return False, f"network namespaces not permitted here: {type(e).__name__}: {e}"
    return True, ""


@functools.lru_cache(maxsize=1)
def nat_available() -> tuple[bool, str]:
    """``(True, "")`` if a lab with a host behind a home router (iptables NAT in a namespace) can be built here."""
    ok, why = netns_available()
    if not ok:
        return ok, why
    try:
        with NetnsLab(2, nat=[1]) as lab:
            _run(lab.run_args(1, ["true"]))
    except NetnsError as e:
        return False, f"no NAT in network namespaces here (apt install iptables): {e}"
    return True, ""


def start_lab_swarm(lab: NetnsLab, started: list, out_dir: Path,
                    peer_args: Sequence[Sequence | Callable[[list[str]], Sequence]], *,
                    prefix: Callable[[int], list] = lambda i: [], boot_args: Sequence = ()
                    ) -> tuple["Proc", list[str], dict[str, "Proc"]]:
    """Starts a bootstrap node in host 0 (with flags ``boot_args``) and peer ``p<i>`` in host ``i`` for
    i = 1..len(peer_args), each listening on its host's address only; returns (bootstrap, its --initial-peers,
    {name: peer}).

    Peer i runs ``swarm-peer run --config configs/demo.toml`` with run dir ``out_dir/p<i>`` (JSON events in
    ``events.jsonl`` there) and its flags ``peer_args[i-1]`` (or, when that is callable, what it returns for the
    bootstrap's --initial-peers), behind ``prefix(i)`` (e.g. a taskset). Every
    process is appended to ``started`` as soon as it runs, so the caller's cleanup reaches it. The peers start
    with ``--no-reachability-check`` (a peer's flags may turn it back on): each check has the bootstrap node
    start a throw-away daemon to dial back, which on this one machine lands on the swarm's first rounds
    (tests/test_nat.py tests the check itself).
    """
    from helpers import Proc

    repo = Path(__file__).resolve().parents[1]
    boot = Proc.start(lab.run_args(0, [sys.executable, "-m", "bootstrap", "--host-maddrs", f"/ip4/{lab.addr(0)}/tcp/0",
                                       "--identity-path", str(out_dir / "boot.id"), *boot_args]),
                      log_path=out_dir / "boot.log", cwd=repo)
    started.append(boot)
    initial = boot.wait_for_line(r"^--initial-peers (.+)$", timeout=60).group(1).split()
    assert all(m.startswith(f"/ip4/{lab.addr(0)}/") for m in initial), initial
    peers = {}
    for i, args in enumerate(peer_args, start=1):
        name, run_dir = f"p{i}", out_dir / f"p{i}"
        args = args(initial) if callable(args) else args
        cmd = [sys.executable, "-m", "peer", "run", "--config", repo / "configs/demo.toml", "--initial-peers",
               *initial, "--host-maddrs", f"/ip4/{lab.addr(i)}/tcp/0", "--run-dir", run_dir,
               "--log-json", run_dir / "events.jsonl", "--no-reachability-check", *args]
        peers[name] = Proc.start(lab.run_args(i, [*prefix(i), *cmd]), log_path=out_dir / f"{name}.log", cwd=repo)
        started.append(peers[name])
    return boot, initial, peers
