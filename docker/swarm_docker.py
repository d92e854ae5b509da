#!/usr/bin/env python3
"""``swarm-docker``: the container glue of swarmloco's image (installed as /usr/local/bin/swarm-docker).

Usage::

    swarm-docker swarm-peer ARGS...        prepare the environment (below), then exec ``swarm-peer ARGS...``
    swarm-docker swarm-bootstrap ARGS...   prepare the environment (below), then exec ``swarm-bootstrap ARGS...``
    swarm-docker health [peer|bootstrap] [--pid PID] [--run-dir DIR] [--log-json FILE] [--max-age SECONDS]

The preparation only does something when the container asks for it with these variables (docker/compose.yaml
sets them; none of them is a swarm-peer config key, and nothing here changes a config value the user gave):

``SWARMLOCO_RUN_SLOTS=DIR`` (peer)
    Replicas of one compose service share one named volume. Each container takes the first free run dir
    ``DIR/peer-0``, ``DIR/peer-1``, ... by holding an exclusive ``flock`` on ``DIR/peer-N/.lock`` for as long as
    the peer runs (the lock's file descriptor is inherited by ``swarm-peer``), and sets ``SWARM_RUN_DIR`` and
    ``SWARM_LOG_JSON`` to it. A restarted or re-created container takes a free slot again and resumes from the
    checkpoint and identity found there. Skipped when ``--run-dir`` is given on the command line.
``SWARMLOCO_BOOTSTRAP_FILE=FILE`` (both)
    The bootstrap node computes its peer id from its identity file (created on first start, kept in its
    volume), writes ``/dns4/HOST/tcp/PORT/p2p/PEER_ID`` to FILE, then starts. A peer given no initial peers
    (no ``--initial-peers`` / ``SWARM_INITIAL_PEERS`` / config file entry, and no ``--new-swarm``) waits for
    FILE (up to ``SWARMLOCO_BOOTSTRAP_WAIT`` seconds, default 120), resolves HOST to its current IPv4 address
    and passes ``/ip4/IP/tcp/PORT/p2p/PEER_ID`` as ``SWARM_INITIAL_PEERS``.
``SWARMLOCO_BOOTSTRAP_HOST=NAME`` (bootstrap)
    The host name written to FILE (default: the container's hostname; compose sets ``hostname: bootstrap``).
``SWARMLOCO_ANNOUNCE_SELF=1`` (both)
    When nothing is announced and the node listens on ``/ip4/0.0.0.0/tcp/PORT`` (PORT fixed), announce
    ``/ip4/<this container's IP>/tcp/PORT``, so other containers are never told loopback addresses.

``health`` (the image's HEALTHCHECK) finds the running ``swarm-peer`` or ``swarm-bootstrap`` process in
``/proc`` (or ``--pid``), re-reads its command line, environment and working directory with the same parsers
the commands use, and checks:

- peer: asks the peer through its local control API (``RUN_DIR/control.json``, peer/control/): it must answer
  within 8 s and, while training, have made an inner step within ``--max-age`` seconds
  (``SWARMLOCO_HEALTH_MAX_AGE``, default 300); a paused or starting peer is healthy. A peer that serves no control
  API (``run.control = false``) is judged by its files instead: the newest of ``RUN_DIR/peer.log``, the
  ``--log-json`` file and ``RUN_DIR/checkpoints`` was modified at most ``--max-age`` seconds ago.
  ``--run-dir`` checks a directory directly, without looking for a process.
- bootstrap: the process runs, its identity file exists (and the bootstrap FILE, if configured), and its
  listening TCP port accepts a connection.

Exit status 0 = healthy, 1 = unhealthy, with one line saying why (``docker inspect`` shows it).
This file imports only the standard library and the light ``peer.cli.swarm_peer`` / ``bootstrap.cli`` modules
(hivemind and torch are imported only by the bootstrap preparation, to read the identity's peer id).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

COMMANDS = ("swarm-peer", "swarm-bootstrap")
DEFAULT_MAX_AGE = 300.0
DEFAULT_BOOTSTRAP_WAIT = 120.0
_HOST_RE = re.compile(r"^/ip4/(?P<host>[0-9.]+)/tcp/(?P<port>\d+)$")
_DNS_RE = re.compile(r"^/dns4?/(?P<name>[^/]+)/(?P<rest>.*)$")


class PrepareError(Exception):
    """The container cannot start as configured (reported as one line, exit status 2)."""


def _truthy(value: Optional[str]) -> bool:
    return str(value or "").strip().lower() in ("1", "true", "yes", "on")


def _say(msg: str) -> None:
    print(f"swarm-docker: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- addresses

def fixed_listen_port(host_maddrs: Sequence[str]) -> Optional[int]:
    """The port of the first ``/ip4/HOST/tcp/PORT`` listen address with a fixed (non-zero) port."""
    for maddr in host_maddrs:
        m = _HOST_RE.match(maddr)
        if m and int(m["port"]) != 0:
            return int(m["port"])
    return None


def container_ip() -> Optional[str]:
    """This container's IPv4 address on its network (Docker maps the hostname to it in /etc/hosts)."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


def self_announce(host_maddrs: Sequence[str], ip: Optional[str]) -> Optional[str]:
    """``/ip4/IP/tcp/PORT`` when we listen on all interfaces at one fixed port, else None."""
    if not ip or len(host_maddrs) != 1:
        return None
    m = _HOST_RE.match(host_maddrs[0])
    if not m or m["host"] != "0.0.0.0" or int(m["port"]) == 0:
        return None
    return f"/ip4/{ip}/tcp/{m['port']}"


def resolve_ipv4(name: str) -> str:
    infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    return infos[0][4][0]


def dial_form(maddrs: Sequence[str], resolve: Callable[[str], str]) -> list[str]:
    """``/dns4/NAME/...`` -> ``/ip4/<resolved>/...`` (the peer's address check expects /ip4/)."""
    out = []
    for maddr in maddrs:
        m = _DNS_RE.match(maddr)
        out.append(f"/ip4/{resolve(m['name'])}/{m['rest']}" if m else maddr)
    return out


def read_bootstrap_file(path: Path, *, wait: float, resolve: Callable[[str], str],
                        sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """The bootstrap's multiaddrs from ``path`` in dialable form; waits for the file and its name to resolve."""
    deadline = time.monotonic() + wait
    last_error = "not written yet"
    while True:
        try:
            maddrs = path.read_text().split()
            if maddrs:
                return dial_form(maddrs, resolve)
            last_error = "empty"
        except FileNotFoundError:
            last_error = "not written yet"
        except OSError as e:  # socket.gaierror (name not resolvable yet) is an OSError too
            last_error = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise PrepareError(f"bootstrap address file {path}: {last_error} after {wait:g}s (is the bootstrap "
                               f"service running? or set SWARM_INITIAL_PEERS / --initial-peers yourself)")
        sleep(1.0)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------- run slots

def claim_slot(base: Path, *, prefix: str = "peer-", limit: int = 4096) -> tuple[Path, int]:
    """Locks the first free ``base/prefix<N>`` (exclusive, non-blocking flock); returns (dir, lock fd).

    The lock lives as long as the returned descriptor (and its copies in exec'd / forked processes)."""
    base.mkdir(parents=True, exist_ok=True)
    for n in range(limit):
        slot = base / f"{prefix}{n}"
        slot.mkdir(exist_ok=True)
        fd = os.open(slot / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode())
        return slot, fd
    raise PrepareError(f"{base}: no free run slot among {prefix}0..{prefix}{limit - 1}")


# ----------------------------------------------------------------------------------------------- prepare

def _quiet(fn, *args, **kwargs):
    """Calls fn with stdout/stderr swallowed; argparse's --help / errors become SystemExit."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*args, **kwargs)


def prepare_peer(argv: Sequence[str], env: dict[str, str], *, resolve: Callable[[str], str] = resolve_ipv4,
                 ip: Optional[str] = None, wait: Optional[float] = None) -> tuple[dict[str, str], Optional[int]]:
    """The environment to exec ``swarm-peer argv`` with, and the run slot's lock fd (or None)."""
    from peer.cli.swarm_peer import build_parser, parse_overrides
    from peer.config import ConfigError
    from peer.config.load import build_config

    env = dict(env)
    try:
        ns = _quiet(build_parser().parse_args, list(argv))
        overrides = parse_overrides(ns)
        # Each call pins one of the two initial-peer settings so the other one is read from flags/env/file.
        cfg = build_config(ns.config, {**overrides, ("swarm", "new_swarm"): True}, environ=env)
        new_swarm = build_config(ns.config, {**overrides, ("swarm", "initial_peers"): ["/p2p/x"]},
                                 environ=env).swarm.new_swarm
    except (SystemExit, ConfigError, ValueError):
        return env, None  # --help or a config error: swarm-peer itself prints it
    lock_fd = None
    if env.get("SWARMLOCO_RUN_SLOTS"):
        if ("run", "run_dir") in overrides:
            _say("--run-dir given on the command line: SWARMLOCO_RUN_SLOTS ignored")
        else:
            slot, lock_fd = claim_slot(Path(env["SWARMLOCO_RUN_SLOTS"]))
            env["SWARM_RUN_DIR"] = str(slot)
            if ("run", "log_json") not in overrides:
                env["SWARM_LOG_JSON"] = str(slot / "events.jsonl")
            _say(f"run dir {slot} (slot lock held while the peer runs)")
    if _truthy(env.get("SWARMLOCO_ANNOUNCE_SELF")) and not cfg.swarm.announce_maddrs:
        announce = self_announce(cfg.swarm.host_maddrs, ip if ip is not None else container_ip())
        if announce:
            env["SWARM_ANNOUNCE_MADDRS"] = announce
            _say(f"announcing {announce}")
    if env.get("SWARMLOCO_BOOTSTRAP_FILE") and not cfg.swarm.initial_peers and not new_swarm:
        if wait is None:
            wait = float(env.get("SWARMLOCO_BOOTSTRAP_WAIT") or DEFAULT_BOOTSTRAP_WAIT)
        maddrs = read_bootstrap_file(Path(env["SWARMLOCO_BOOTSTRAP_FILE"]), wait=wait, resolve=resolve)
        env["SWARM_INITIAL_PEERS"] = " ".join(maddrs)
        _say(f"initial peers from {env['SWARMLOCO_BOOTSTRAP_FILE']}: {env['SWARM_INITIAL_PEERS']}")
    return env, lock_fd


def _peer_id_of_identity(path: str) -> str:
    from peer.net.plumbing.dht import ensure_identity  # imports hivemind (and torch): only here

    return ensure_identity(path)


def prepare_bootstrap(argv: Sequence[str], env: dict[str, str], *,
                      peer_id_of: Callable[[str], str] = _peer_id_of_identity,
                      ip: Optional[str] = None, hostname: Optional[str] = None) -> dict[str, str]:
    """The environment to exec ``swarm-bootstrap argv`` with; writes the bootstrap address file if asked."""
    from bootstrap.cli import UsageError, parse_args

    env = dict(env)
    try:
        args = _quiet(parse_args, list(argv), env=env)
    except (SystemExit, UsageError):
        return env  # --help or a bad flag: swarm-bootstrap itself prints it
    if _truthy(env.get("SWARMLOCO_ANNOUNCE_SELF")) and not args.announce_maddrs:
        announce = self_announce(args.host_maddrs, ip if ip is not None else container_ip())
        if announce:
            env["SWARM_ANNOUNCE_MADDRS"] = announce
            _say(f"announcing {announce}")
    if env.get("SWARMLOCO_BOOTSTRAP_FILE"):
        port = fixed_listen_port(args.host_maddrs)
        if port is None:
            raise PrepareError("SWARMLOCO_BOOTSTRAP_FILE needs a fixed listen port: "
                               "--host-maddrs /ip4/0.0.0.0/tcp/PORT")
        try:
            peer_id = peer_id_of(args.identity_path)  # creates the identity on first start
        except (OSError, ValueError) as e:
            raise PrepareError(f"--identity-path {args.identity_path}: {e}") from None
        host = env.get("SWARMLOCO_BOOTSTRAP_HOST") or hostname or socket.gethostname()
        maddr = f"/dns4/{host}/tcp/{port}/p2p/{peer_id}"
        write_atomic(Path(env["SWARMLOCO_BOOTSTRAP_FILE"]), maddr + "\n")
        _say(f"wrote {maddr} to {env['SWARMLOCO_BOOTSTRAP_FILE']}")
    return env


def launch(command: str, argv: Sequence[str]) -> int:
    env = dict(os.environ)
    lock_fd = None
    try:
        if command == "swarm-peer":
            env, lock_fd = prepare_peer(argv, env)
        else:
            env = prepare_bootstrap(argv, env)
    except PrepareError as e:
        _say(f"error: {e}")
        return 2
    if lock_fd is not None:
        os.set_inheritable(lock_fd, True)  # the lock must outlive this exec: swarm-peer holds the slot
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command, [command, *argv], env)
    return 127  # pragma: no cover (exec does not return)


# ----------------------------------------------------------------------------------------------- health

def _proc_argv(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _split_command(argv: Sequence[str]) -> Optional[tuple[str, list[str]]]:
    """(command, its args) when argv runs swarm-peer / swarm-bootstrap (directly or as a python script)."""
    for i, arg in enumerate(argv[:2]):
        if os.path.basename(arg) in COMMANDS:
            return os.path.basename(arg), list(argv[i + 1:])
    return None


def find_process(role: Optional[str]) -> Optional[int]:
    """The lowest pid running swarm-peer / swarm-bootstrap (a forked child has the same command line)."""
    want = {"peer": "swarm-peer", "bootstrap": "swarm-bootstrap"}.get(role or "", None)
    pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            found = _split_command(_proc_argv(pid))
        except OSError:
            continue
        if found and (want is None or found[0] == want):
            return pid
    return None


def _proc_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # not ours to read: fall back to the container's configured environment
        return dict(os.environ)
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep:
            out[key] = value
    return out


def _max_age(opt: Optional[float], env: dict[str, str]) -> float:
    if opt is not None:
        return opt
    raw = os.environ.get("SWARMLOCO_HEALTH_MAX_AGE") or env.get("SWARMLOCO_HEALTH_MAX_AGE")
    return float(raw) if raw else DEFAULT_MAX_AGE


def check_control(run_dir: Path, max_age: float) -> tuple[bool, str]:
    """Healthy when the peer answers its control API and, while training, made a step within max_age seconds."""
    from peer.control.client import ControlClient, ControlError
    from peer.proto import control_pb2 as pb

    try:
        with ControlClient(run_dir, timeout=8.0) as client:
            s = client.status()
    except ControlError as e:
        return False, str(e)
    state = pb.PeerState.Name(s.state).lower()
    if s.state == pb.TRAINING and s.idle_seconds > max_age:
        return False, f"training, but no step for {s.idle_seconds:.0f}s (> {max_age:g}s): the peer looks stuck"
    return True, f"{state}, step {s.step}, {s.live_peers} live peer(s)"


def check_run_dir(run_dir: Path, log_json: Optional[Path], max_age: float,
                  now: Optional[float] = None) -> tuple[bool, str]:
    """Through the control API when the peer serves one; otherwise healthy when its newest output (peer.log,
    events, checkpoints) is at most max_age seconds old."""
    if (run_dir / "control.json").is_file():
        return check_control(run_dir, max_age)
    now = time.time() if now is None else now
    candidates = [run_dir / "peer.log", run_dir / "checkpoints"] + ([log_json] if log_json else [])
    mtimes = {}
    for path in candidates:
        with contextlib.suppress(OSError):
            mtimes[path] = path.stat().st_mtime
    if not mtimes:
        return False, f"nothing written yet in {run_dir} (peer.log, events, checkpoints)"
    newest = max(mtimes, key=mtimes.get)
    age = now - mtimes[newest]
    if age > max_age:
        return False, f"{newest} last written {age:.0f}s ago (> {max_age:g}s): the peer looks stuck"
    return True, f"{newest} written {age:.0f}s ago"


def check_peer(args: Sequence[str], env: dict[str, str], max_age: float,
               cwd: Optional[str] = None) -> tuple[bool, str]:
    """The peer's run dir and event log, from its args and env (relative paths: relative to its cwd)."""
    from peer.cli.swarm_peer import build_parser, parse_overrides
    from peer.config import ConfigError
    from peer.config.load import build_config

    base = Path(cwd) if cwd else Path.cwd()
    try:
        ns = _quiet(build_parser().parse_args, list(args))
        cfg = build_config(str(base / ns.config) if ns.config else None, parse_overrides(ns), environ=env)
    except (SystemExit, ConfigError, ValueError) as e:
        return False, f"cannot read the peer's config: {e}"
    log_json = base / cfg.run.log_json if cfg.run.log_json else None
    return check_run_dir(base / cfg.run.run_dir, log_json, max_age)


def tcp_accepts(host: str, port: int, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def check_bootstrap(args: Sequence[str], env: dict[str, str], cwd: Optional[str] = None) -> tuple[bool, str]:
    """Identity (and address file) present, and the listening TCP port accepts a connection."""
    from bootstrap.cli import UsageError, parse_args

    try:
        ns = _quiet(parse_args, list(args), env=env)
    except (SystemExit, UsageError) as e:
        return False, f"cannot read the bootstrap's flags: {e}"
    identity = (Path(cwd) if cwd else Path.cwd()) / ns.identity_path
    if not identity.is_file() or identity.stat().st_size == 0:
        return False, f"identity file {identity} missing"
    if env.get("SWARMLOCO_BOOTSTRAP_FILE") and not Path(env["SWARMLOCO_BOOTSTRAP_FILE"]).is_file():
        return False, f"bootstrap address file {env['SWARMLOCO_BOOTSTRAP_FILE']} missing"
    listening = [(m["host"], int(m["port"])) for m in map(_HOST_RE.match, ns.host_maddrs) if m and m["port"] != "0"]
    if not listening:
        return True, f"running, identity {identity} (no fixed TCP port to probe)"
    for host, port in listening:
        if tcp_accepts("127.0.0.1" if host == "0.0.0.0" else host, port):
            return True, f"listening on tcp/{port}, identity {identity}"
    return False, f"nothing accepts connections on {', '.join(f'{h}:{p}' for h, p in listening)}"


def health(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="swarm-docker health", description="Container health check (exit 0/1).")
    p.add_argument("role", nargs="?", choices=("peer", "bootstrap"), help="default: whichever is running")
    p.add_argument("--pid", type=int, help="check this process (default: found in /proc)")
    p.add_argument("--run-dir", help="check this peer run dir directly, without looking for a process")
    p.add_argument("--log-json", help="with --run-dir: the peer's JSON event log")
    p.add_argument("--max-age", type=float, help=f"peer: seconds (default $SWARMLOCO_HEALTH_MAX_AGE or "
                                                 f"{DEFAULT_MAX_AGE:g})")
    opts = p.parse_args(argv)
    if opts.run_dir:
        ok, why = check_run_dir(Path(opts.run_dir), Path(opts.log_json) if opts.log_json else None,
                                _max_age(opts.max_age, {}))
    else:
        pid = opts.pid or find_process(opts.role)
        found = None
        if pid:
            with contextlib.suppress(OSError):
                found = _split_command(_proc_argv(pid))
        if not found:
            print(f"unhealthy: no {opts.role or 'swarm-peer/swarm-bootstrap'} process running")
            return 1
        command, args = found
        env = _proc_env(pid)
        try:  # relative paths in its flags are relative to its working directory
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = None
        if command == "swarm-peer":
            ok, why = check_peer(args, env, _max_age(opts.max_age, env), cwd)
        else:
            ok, why = check_bootstrap(args, env, cwd)
        why = f"{command} (pid {pid}): {why}"
    print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "health":
        try:
            return health(argv[1:])
        except SystemExit as e:  # --help (0) or a bad option: Docker reserves status 2
            return 0 if e.code in (0, None) else 1
        except Exception as e:  # a health check must answer 0 or 1, never crash with another status
            print(f"unhealthy: health check failed: {type(e).__name__}: {e}")
            return 1
    if argv and argv[0] in COMMANDS:
        return launch(argv[0], argv[1:])
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
