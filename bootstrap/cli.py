"""``swarm-bootstrap``: a DHT-only node that other peers (and other bootstrap nodes) join through.

No model and no training code. Note that hivemind itself imports torch (its ``MPFuture`` keeps state in
torch shared memory), so the import happens lazily, after the flags are parsed: ``--help`` stays instant.

Every flag has an environment twin ``SWARM_<FLAG>`` (``--host-maddrs`` -> ``SWARM_HOST_MADDRS``; lists are
space- or comma-separated). A flag given on the command line wins over its environment variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from typing import Any, Callable, Mapping, Sequence

from bootstrap.usage import PROG, Parser, UsageError
from peer.config.fields import MAX_RECORD_TTL

ENV_PREFIX = "SWARM_"
DEFAULT_HOST_MADDRS = ["/ip4/0.0.0.0/tcp/31337"]
DEFAULT_IDENTITY_PATH = "bootstrap.id"
DEFAULT_REFRESH_PERIOD = 60.0
DEFAULT_JOIN_TIMEOUT = 60.0
RELAY_TRIES = 3  # starts of the DHT node while its relay serves with libp2p's default limits (--relay-service)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

logger = logging.getLogger("swarm.bootstrap")


class _Stop(BaseException):
    """Raised by the signal handler while the node is still starting up."""


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def split_list(values: Sequence[str]) -> list[str]:
    """Flatten values that may themselves hold several items separated by spaces or commas."""
    return [item for value in values for item in re.split(r"[\s,]+", value) if item]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        description="Run a DHT-only bootstrap node for a swarmloco swarm. Prints one line to stdout: "
        "'--initial-peers MADDR ...', ready to paste into other peers' command lines.",
        epilog="Every flag can also be set with an environment variable SWARM_<FLAG_IN_UPPER_SNAKE>, "
        "e.g. SWARM_HOST_MADDRS='/ip4/0.0.0.0/tcp/31337'; lists are space- or comma-separated.",
    )
    lst: dict[str, Any] = dict(nargs="+", action="extend", default=None, metavar="MADDR")
    p.add_argument("--host-maddrs", **lst,
                   help=f"multiaddrs to listen on (repeatable; default {' '.join(DEFAULT_HOST_MADDRS)})")
    p.add_argument("--announce-maddrs", **lst,
                   help="multiaddrs to announce instead of the listening ones, e.g. a public IP (repeatable)")
    p.add_argument("--initial-peers", **lst,
                   help="other bootstrap nodes to join (repeatable; empty is fine for the first node)")
    p.add_argument("--identity-path", default=None, metavar="PATH",
                   help=f"libp2p private key file; created if missing, gives a stable peer id "
                        f"(default ./{DEFAULT_IDENTITY_PATH})")
    p.add_argument("--nat-port-map", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the LAN gateway for a port mapping via UPnP/NAT-PMP (off by default: it sends "
                        "discovery packets to the gateway and multicast)")
    p.add_argument("--relay-service", action=argparse.BooleanOptionalAction, default=None,
                   help="relay for peers behind a NAT that name this node in their --relay-via (libp2p circuit "
                        "relay, up to 30 min and 4 GiB per relayed connection; their inbound traffic crosses this "
                        "node's link; off by default)")
    p.add_argument("--refresh-period", default=None, metavar="SECONDS",
                   help=f"seconds between status log lines (default {DEFAULT_REFRESH_PERIOD:g})")
    p.add_argument("--join-timeout", default=None, metavar="SECONDS",
                   help=f"seconds to keep retrying --initial-peers (with backoff) before giving up with their "
                        f"addresses (default {DEFAULT_JOIN_TIMEOUT:g})")
    p.add_argument("--authority", default=None, metavar="DIR",
                   help="serve an authenticated run: only peers with a pass from the authority in DIR (swarm-bootstrap "
                        "authority init DIR) may use this node; publishes DIR/revoked.txt every --refresh-period")
    p.add_argument("--log-level", default=None, metavar="LEVEL",
                   help=f"one of {', '.join(LOG_LEVELS)} (default INFO)")
    return p


def _pick(cli_value, flag: str, env: Mapping[str, str], default, convert: Callable = lambda v: v):
    """CLI value if given, else the environment twin, else the default -- converted, errors naming both."""
    if cli_value is not None:
        source, raw = flag, cli_value
    elif env.get(env_name(flag), "").strip():
        source, raw = f"{env_name(flag)} ({flag})", env[env_name(flag)]
    else:
        return default
    try:
        return convert(raw)
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None


def _positive_float(raw) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{raw!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{raw!r} must be a positive number of seconds")
    return value


def _bool(raw) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _level(raw) -> str:
    level = str(raw).strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"{raw!r} is not one of {', '.join(LOG_LEVELS)}")
    return level


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse flags and their SWARM_* twins; raises UsageError with a one-line, flag-naming message."""
    env = dict(os.environ) if env is None else env
    args = build_parser().parse_args(argv)
    as_list = lambda v: split_list([v] if isinstance(v, str) else v)  # noqa: E731
    args.host_maddrs = _pick(args.host_maddrs, "--host-maddrs", env, DEFAULT_HOST_MADDRS, as_list)
    args.announce_maddrs = _pick(args.announce_maddrs, "--announce-maddrs", env, [], as_list)
    args.initial_peers = _pick(args.initial_peers, "--initial-peers", env, [], as_list)
    args.identity_path = _pick(args.identity_path, "--identity-path", env, DEFAULT_IDENTITY_PATH, str)
    args.nat_port_map = _pick(args.nat_port_map, "--nat-port-map", env, False, _bool)
    args.relay_service = _pick(args.relay_service, "--relay-service", env, False, _bool)
    args.refresh_period = _pick(args.refresh_period, "--refresh-period", env, DEFAULT_REFRESH_PERIOD,
                                _positive_float)
    args.join_timeout = _pick(args.join_timeout, "--join-timeout", env, DEFAULT_JOIN_TIMEOUT, _positive_float)
    args.log_level = _pick(args.log_level, "--log-level", env, "INFO", _level)
    args.authority = _pick(args.authority, "--authority", env, "", str)
    if not args.host_maddrs:
        raise UsageError("--host-maddrs: at least one address is required")
    if not args.identity_path.strip():
        raise UsageError("--identity-path: must not be empty")
    if 3 * args.refresh_period > MAX_RECORD_TTL:  # (the revocation list is stored for three periods)
        raise UsageError(f"--refresh-period: at most {MAX_RECORD_TTL / 3:.0f} seconds (DHT nodes keep no record "
                         f"longer than {MAX_RECORD_TTL:.0f} s)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["authority"]:
        from bootstrap import authority

        return authority.main(argv[1:])
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s " + PROG + ": %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(args.log_level)
    logger.propagate = False  # the root logger (torch, ...) keeps Python's default: warnings only

    main_pid = os.getpid()
    stop = threading.Event()
    running = False

    def on_signal(signum, _frame):
        if os.getpid() != main_pid:  # a forked child (the DHT process) inherited this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        logger.info(f"got {signal.Signals(signum).name}, shutting down")
        stop.set()
        if not running:
            raise _Stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    dht = None
    dial_back = None
    try:
        from peer.net.plumbing import addresses, dht as dht_node  # import hivemind (and through it torch) lazily
        from peer.net.plumbing.dial_back import DialBackService
        from peer.net.trust.progress import node_validators

        logging.getLogger("hivemind").setLevel(max(logging.getLevelName(args.log_level), logging.INFO))
        if args.nat_port_map:
            logger.warning("--nat-port-map is on: p2pd will send UPnP/NAT-PMP discovery to the LAN gateway")
        try:
            addresses.check_maddrs(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs,
                                   announce_maddrs=args.announce_maddrs)
        except ValueError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        try:
            run_authority = _run_authority(args.authority, args.identity_path) if args.authority else None
        except (ValueError, OSError) as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        if run_authority is None:
            logger.info("open: any peer may use this node (--authority DIR serves an authenticated run)")
        else:
            logger.info(f"authenticated: only peers with a pass from authority {run_authority.fingerprint} may use "
                        f"this node")
        logger.info(f"starting DHT node: listen {' '.join(args.host_maddrs)}, identity {args.identity_path}, "
                    f"{len(args.initial_peers)} initial peer address(es)")
        security = dict(run_authority.dht_kwargs) if run_authority else {}
        security["record_validators"] = [*node_validators(), *security.get("record_validators", ())]
        for attempt in range(1, RELAY_TRIES + 1):
            try:
                dht = dht_node.create_dht(
                    initial_peers=args.initial_peers,
                    host_maddrs=args.host_maddrs,
                    announce_maddrs=args.announce_maddrs,
                    identity_path=args.identity_path,
                    client_mode=False,
                    nat_port_map=args.nat_port_map,
                    relay_service=args.relay_service,
                    join_timeout=args.join_timeout,
                    stop=stop,
                    **security,
                )
            except ValueError as e:
                print(f"{PROG}: error: {e}", file=sys.stderr)
                return 2
            except dht_node.JoinError as e:
                if stop.is_set():  # a signal while the initial peers were retried: a clean stop
                    return 0
                print(f"{PROG}: error: {e}", file=sys.stderr)
                return 3
            except RuntimeError as e:
                logger.error(f"could not start the DHT node: {e}")
                return 1
            if stop.is_set() or not args.relay_service or _relay_ok(dht_node.visible_maddrs(dht), attempt,
                                                                    args.join_timeout):
                break
            dht_node.shutdown_dht(dht)
            dht = None
        assert dht is not None  # (_relay_ok keeps the last start)
        running = True
        if stop.is_set():
            return 0

        maddrs = dht_node.visible_maddrs(dht)
        logger.info(f"peer id: {dht.peer_id.to_base58()}")
        logger.info(f"identity file: {os.path.abspath(args.identity_path)}")
        logger.info(f"listening on: {' '.join(args.host_maddrs)}")
        if args.announce_maddrs:
            logger.info(f"announcing: {' '.join(args.announce_maddrs)}")
        logger.info(f"visible multiaddrs: {' '.join(maddrs) or '(none)'}")
        if args.initial_peers:
            logger.info(f"joined through {len(args.initial_peers)} initial peer address(es)")
        if args.relay_service:
            logger.info("relay service on: peers behind a NAT may pass --relay-via with a visible multiaddr above")
        dial_back = DialBackService()  # answers `swarm-peer doctor`'s "can others dial me?"
        try:
            dial_back.start(dht)
        except Exception as e:  # (the node works without it; the doctor then judges from the addresses)
            logger.warning(f"dial-back service not available: {type(e).__name__}: {e}")
        print("--initial-peers " + " ".join(maddrs), flush=True)

        if run_authority is not None:
            run_authority.publish(dht, args.refresh_period)
        while not stop.wait(args.refresh_period):
            if run_authority is not None:
                run_authority.publish(dht, args.refresh_period)
            if not dht.is_alive():
                logger.error("the DHT process died unexpectedly")
                return 1
            try:
                dht_peers, connections = dht_node.peer_counts(dht)
            except Exception as e:  # a slow or dying DHT process must not kill the status loop
                logger.warning(f"status query failed: {type(e).__name__}: {e}")
                continue
            logger.info(f"DHT peers in routing table: {dht_peers} (open libp2p connections: {connections})")
        return 0
    except _Stop:
        return 0
    finally:
        running = True  # a second signal during shutdown must not interrupt it
        if dial_back is not None:
            dial_back.stop()
        if dht is not None:
            dht_node.shutdown_dht(dht)
            logger.info("DHT node shut down")


def _relay_ok(maddrs: list[str], attempt: int, timeout: float) -> bool:
    """Whether to keep this start of the DHT node: its relay carried a stream past libp2p's default limits
    (peer/net/plumbing/relay_check.py), it could not tell, or this was the last of ``RELAY_TRIES`` starts."""
    from peer.net.plumbing.relay_check import PROBE_BYTES, relay_serves

    local = [m for m in maddrs if m.startswith("/ip4/127.")] or maddrs
    verdict = relay_serves(local[0], timeout) if local else None
    if verdict is None:
        logger.warning(f"relay check: no circuit through this node within {timeout:g} s; whether relayed streams "
                       f"carry more than 128 KiB is not known")
    elif verdict:
        logger.info(f"relay check: a relayed stream carried {PROBE_BYTES // 1024} KiB")
    elif attempt < RELAY_TRIES:
        logger.warning(f"relay check: relayed streams are reset after 128 KiB (libp2p's default relay limits "
                       f"serve); starting the DHT node again ({attempt}/{RELAY_TRIES})")
        return False
    else:
        logger.error(f"relay check: relayed streams are still reset after 128 KiB after {RELAY_TRIES} starts: peers "
                     f"behind a NAT cannot exchange their parts through this node; restart it")
    return True


def _run_authority(directory: str, identity_path: str):
    """The authenticated-run side of this node (bootstrap/authority.py), or ValueError naming what to fix."""
    from bootstrap.authority import AuthorityError, NodeAuthority

    try:
        return NodeAuthority.create(directory, identity_path)
    except AuthorityError as e:
        raise ValueError(f"--authority: {e}") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
