"""Process utilities for tests that start real processes (bootstrap nodes, peers).

Every process runs in its own session (``start_new_session=True``), so the p2pd daemons that hivemind spawns
under it stay in that session/process group: ``kill_group`` removes them even after the main process died,
and ``session_pids`` tells whether anything is left. Waits are deadline-bounded polls, never bare sleeps.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import io
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, TypeVar

import forks

# Polls: every 50 ms for the first seconds of a wait, then every 250 ms (a swarm test waits minutes, re-reading
# every peer's events and logs each time: on two cores that reading competes with the peers it waits for).
POLL_INTERVAL, LONG_POLL_INTERVAL, LONG_WAIT_S = 0.05, 0.25, 2.0
TAIL_LINES = 40

T = TypeVar("T")


class ProcessExited(TimeoutError):
    """The awaited log line cannot come any more: the process has exited (a kind of TimeoutError)."""


def in_process(main: Callable[[list[str]], int], *args: str) -> subprocess.CompletedProcess:
    """A command line's ``main(args)`` run in this process, its output captured: the command's own code without
    the seconds of imports a new interpreter costs (``swarm-peer export``, ``swarm-bootstrap authority ...``)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def poll_pause(started: float) -> None:
    """The pause between two polls of a wait that began at ``started`` (monotonic)."""
    time.sleep(POLL_INTERVAL if time.monotonic() - started < LONG_WAIT_S else LONG_POLL_INTERVAL)


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Poll ``predicate`` until it returns something truthy (which is returned) or ``timeout`` s pass."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        poll_pause(started)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the ``(comm)`` field: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()


def pids_in_session(sid: int) -> list[int]:
    """Live (non-zombie) pids whose session id (field 6 of /proc/PID/stat) is ``sid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
                out.append(int(entry))
    return sorted(out)


# Whether ``Proc.start`` forks ``python -m peer|bootstrap`` commands from the tests' zygote (``tests/forks.py``)
# instead of starting a new interpreter: set by conftest for the tests (``TESTS_EXEC_PEERS=1`` turns it off);
# off for the benches, whose peers start as a user's do.
FORK = False
_ZYGOTE: forks.Zygote | None = None
_ZYGOTE_LOCK = threading.Lock()


def _zygote(env: Mapping[str, str]) -> forks.Zygote | None:
    """This process's zygote (started on first use, with ``env``), or None where it cannot fork a command with
    ``env`` (such a command is run through subprocess)."""
    global _ZYGOTE
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None:
            _ZYGOTE = forks.Zygote(env)
            atexit.register(_ZYGOTE.close)
        return _ZYGOTE if _ZYGOTE.serves(env) else None


class Proc:
    """A process started in a new session with stdout+stderr going to ``log_path``."""

    def __init__(self, popen: subprocess.Popen | forks.Forked, log_path: Path, args: Sequence[str]):
        self.popen = popen
        self.log_path = Path(log_path)
        self.args = list(args)

    @classmethod
    def start(
        cls,
        args: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str | None] | None = None,
        cwd=None,
    ) -> "Proc":
        """Start ``args``. ``env`` is layered over ``os.environ`` (a value of None removes a variable);
        ``PYTHONUNBUFFERED=1`` is always set so Python children write their log lines immediately. Where ``FORK``
        is on, ``[ip netns exec NAME] python -m peer|bootstrap ...`` is forked from the zygote."""
        full_env = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = str(value)
        full_env["PYTHONUNBUFFERED"] = "1"
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        fork = forks.forkable(args) if FORK else None
        if fork is not None and (zygote := _zygote(full_env)) is not None:
            netns, module, argv = fork
            child = zygote.spawn(module, argv, env=full_env, log=log_path, cwd=str(cwd or os.getcwd()), netns=netns)
            return cls(child, log_path, args)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                [str(a) for a in args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        return cls(popen, log_path, args)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def lines(self) -> list[str]:
        """All lines written to the log so far (the last one may still be incomplete)."""
        try:
            return self.log_path.read_bytes().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def tail(self, n: int = TAIL_LINES) -> str:
        return "\n".join(self.lines()[-n:])

    def _complete_lines(self) -> list[str]:
        try:
            text = self.log_path.read_bytes().decode(errors="replace")
        except FileNotFoundError:
            return []
        if text and not text.endswith("\n") and self.returncode is None:
            text = text[: text.rfind("\n") + 1]  # the last line is still being written
        return text.splitlines()

    def wait_for_line(self, pattern: str, timeout: float, *, start: int = 0) -> re.Match:
        """First match of regex ``pattern`` in a log line at index >= ``start``, within ``timeout`` s.

        Raises ``TimeoutError`` (or its subclass ``ProcessExited`` as soon as the process has exited
        without printing the line) with the last lines of the log in the message.
        """
        regex = re.compile(pattern)
        started = time.monotonic()
        deadline = started + timeout
        while True:
            exited = self.returncode is not None  # read before the log: no line can be missed
            for line in self._complete_lines()[start:]:
                match = regex.search(line)
                if match:
                    return match
            if exited:
                raise ProcessExited(
                    f"{self.args[:3]} exited with {self.returncode} before printing a line matching "
                    f"{pattern!r}; last lines of {self.log_path}:\n{self.tail()}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no line matching {pattern!r} within {timeout:g} s from {self.args[:3]}; "
                    f"last lines of {self.log_path}:\n{self.tail()}"
                )
            poll_pause(started)

    def session_pids(self) -> list[int]:
        """Pids still alive in this process's session (itself, p2pd daemons, other descendants)."""
        return pids_in_session(self.pid)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group, and to any session member that changed its group."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.session_pids():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGKILL:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def terminate(self, timeout: float) -> int:
        """SIGTERM the main process and wait for its exit code; on timeout SIGKILL the group and raise."""
        if self.returncode is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group(signal.SIGKILL)
            raise TimeoutError(
                f"{self.args[:3]} did not exit within {timeout:g} s of SIGTERM (killed its group); "
                f"last lines of {self.log_path}:\n{self.tail()}"
            ) from None

    def __repr__(self) -> str:
        return f"Proc(pid={self.pid}, returncode={self.returncode}, log={str(self.log_path)!r})"


MESH_DIAL_S = 20.0  # how long p2p_mesh dials a pair before it gives up


async def p2p_mesh(n: int, identities: Optional[list[str]] = None):
    """``n`` hivemind P2P daemons on 127.0.0.1 (NAT mapping off), all connected to each other; ``identities``: their
    libp2p identity files (default: fresh keys nobody holds).

    The caller must ``await p.shutdown()`` each of them (in a ``finally``)."""
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    paths = identities or [None] * n
    common = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, check_if_identity_free=False)
    p2ps = [await P2P.create(**common, identity_path=paths[0])]
    for i in range(1, n):
        first = await p2ps[0].get_visible_maddrs()
        p2ps.append(await P2P.create(**common, identity_path=paths[i], initial_peers=first))
    for a in p2ps:  # full mesh, as the DHT would provide
        for b in p2ps:
            if a is not b:
                addrs = [m.decapsulate("/p2p/" + str(b.peer_id)) for m in await b.get_visible_maddrs()]
                await _dial(a, b, addrs, ControlFailure)
    return p2ps


async def _dial(a, b, addrs, failure) -> None:
    """Connects daemon ``a`` to ``b``. A dial that crosses the daemon's own bootstrap dial can fail its handshake
    ("noise: message is too short"), and libp2p then refuses dials to that address for a few seconds ("dial
    backoff"): the connection may exist anyway (the other dial made it), else it is dialed again once the backoff
    is over, within MESH_DIAL_S seconds."""
    deadline = time.monotonic() + MESH_DIAL_S
    while True:
        try:
            await a._client.connect(b.peer_id, addrs)
            return
        except failure:
            if any(info.peer_id == b.peer_id for info in await a._client.list_peers()):
                return
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)  # (polling the backoff's end: libp2p has no event for it)


@contextlib.contextmanager
def dht_nodes(n: int, tmp_path, *, validators: Callable[[int], Sequence] = lambda i: (),
              client: Callable[[int], bool] = lambda i: False):
    """``n`` real DHT nodes (``peer.net.plumbing.dht.create_dht``: DHT process + p2pd) on 127.0.0.1, each joining
    through the first; node i gets ``validators(i)``, and is in client mode (stores nothing, reads over the network)
    where ``client(i)``. All are shut down on exit, also on failure."""
    from peer.net.plumbing import dht as dht_node

    nodes: list = []
    try:
        for i in range(n):
            initial = dht_node.visible_maddrs(nodes[0]) if nodes else []
            nodes.append(dht_node.create_dht(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                             announce_maddrs=[], identity_path=str(Path(tmp_path) / f"n{i}.id"),
                                             client_mode=client(i), record_validators=validators(i),
                                             startup_timeout=30, wait_timeout=3.0))
        yield nodes
    finally:
        for node in nodes:
            dht_node.shutdown_dht(node)


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _tests_loop() -> asyncio.AbstractEventLoop:
    """The test process's one event loop, started on first use and running in a daemon thread until exit."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="tests-loop", daemon=True).start()
        return _LOOP


def run_async(coro):
    """Runs ``coro`` on the tests' event loop and returns its result; then cancels the tasks it left behind
    (hivemind leaves some, as ``asyncio.run`` would).

    Why one loop that never stops, in its own thread (as ``SwarmNet`` runs its loop): hivemind's ``MPFuture``
    (every DHT call) keeps the loop it was made in, and when its result comes after that loop stopped, its
    background thread runs the loop itself (``run_until_complete``). A fresh loop per call raced that at its
    close ("Cannot close a running event loop"). A loop that is always running gets such results through
    ``run_coroutine_threadsafe``, as in the peer. Must not be called from a coroutine on that loop."""
    loop = _tests_loop()

    async def run_then_cancel_leftovers():
        try:
            return await coro
        finally:
            me = asyncio.current_task()
            left = [task for task in asyncio.all_tasks() if task is not me]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    future = asyncio.run_coroutine_threadsafe(run_then_cancel_leftovers(), loop)
    try:
        return future.result()
    except BaseException:
        future.cancel()  # (the test's timeout fired in this thread: stop the coroutine too)
        raise


def events(run_root, name: str, kind: str | tuple[str, ...]) -> list[dict]:
    """The JSON events of one kind (or of several, in the order written) from ``run_root/name/events.jsonl`` (a
    peer's ``--log-json``), skipping a last line still being written."""
    import json

    path = Path(run_root) / name / "events.jsonl"
    if not path.exists():
        return []
    kinds = (kind,) if isinstance(kind, str) else kind
    lines = path.read_text().splitlines()
    return [e for e in (json.loads(line) for line in lines if line.endswith("}")) if e["event"] in kinds]


def applied_digests(run_root, names: Sequence[str]) -> dict[tuple[int, int], dict[str, str]]:
    """Per (fragment, round), the digest after it of every peer in ``names`` that applied it (its ``round`` event
    says ``applied``), from all of each peer's runs (a restarted peer appends to its events)."""
    out: dict[tuple[int, int], dict[str, str]] = {}
    for name in names:
        for e in events(run_root, name, "round"):
            if e.get("applied"):
                out.setdefault((e["fragment"], e["round"]), {})[name] = e["digest"]
    return out


def assert_one_digest_per_applied_round(run_root, names: Sequence[str], *, shared: int = 1) -> int:
    """The invariant (peer/net/policy/agreement.py): every peer that applies a round holds the same digest after it, for
    every round, no filter. Returns how many rounds more than one peer applied; at least ``shared``."""
    applied = applied_digests(run_root, names)
    off = {k: v for k, v in sorted(applied.items()) if len(set(v.values())) > 1}
    assert not off, f"rounds whose appliers hold different digests: {off}"
    many = sum(len(v) > 1 for v in applied.values())
    assert many >= shared, f"only {many} round(s) applied by more than one peer: {sorted(applied)}"
    return many


def final_digests(run_root, name: str) -> dict[int, str]:
    """Per fragment, the digest of the state a peer ended with: that of its last ``round`` or ``catch_up`` event."""
    out: dict[int, str] = {}
    for e in events(run_root, name, ("round", "catch_up")):
        out[e["fragment"]] = e["digest"]
    return out


def assert_learned(run_root, name: str, *, closed: float) -> float:
    """``name`` learned: the mean of its last two logged losses closed at least ``closed`` of the gap between the
    mean of its first two and the corpus' entropy floor (the cross-entropy no model can beat), and is not below
    the floor by more than a batch's noise (0.1 nats). Returns the fraction closed. Two logs each, not one: a
    single batch's loss moves by ~0.2 nats at the tests' sizes."""
    steps = events(run_root, name, "step")
    assert len(steps) >= 4, f"{name}: only {len(steps)} step events"
    floor = steps[-1]["floor"]
    assert floor is not None, f"{name}: the corpus has no entropy floor"
    first = (steps[0]["loss"] + steps[1]["loss"]) / 2
    last = (steps[-2]["loss"] + steps[-1]["loss"]) / 2
    fraction = (first - last) / (first - floor)
    assert fraction >= closed and last > floor - 0.1, (
        f"{name}: loss {first:.3f} -> {last:.3f} against a floor of {floor:.3f}: closed {fraction:.0%} of the gap, "
        f"expected at least {closed:.0%}")
    return fraction
