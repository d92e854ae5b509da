"""``swarm-peer monitor [--config FILE] [flags] [--port 8080]``: the operator's view of a run's swarm, a web page
and a JSON API on this machine (peer/monitor/). Takes the same config and flags as ``swarm-peer run`` (they name
the run: its id and hash, its initial peers). Runs until Ctrl-C or SIGTERM; exit 0 then, 2 for bad input, 3 when
no initial peer answers."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from peer.config import PeerConfig

EXIT_SETUP, EXIT_JOIN = 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address the page is served on (0.0.0.0: every "
                        "interface; the page shows only what the swarm's records already publish)")
    parser.add_argument("--port", type=int, default=8080, help="port of the page (0: any free one)")
    parser.add_argument("--period", type=float, default=5.0, help="seconds between two reads of the records")


def run(cfg: PeerConfig, ns: argparse.Namespace) -> int:
    if not 0 <= ns.port <= 65535 or not 0.5 <= ns.period <= 3600:
        print("swarm-peer: error: --port must be in 0..65535 and --period in 0.5..3600 s", file=sys.stderr)
        return EXIT_SETUP
    if not cfg.swarm.initial_peers:
        print("swarm-peer: error: the monitor needs --initial-peers (swarm.initial_peers): the run's bootstrap "
              "nodes", file=sys.stderr)
        return EXIT_SETUP
    from peer.errors import JoinError, SetupError
    from peer.monitor.server import Monitor
    from peer.run.preflight import load_access

    try:
        monitor = Monitor(cfg, host=ns.host, port=ns.port, period=ns.period, access=load_access(cfg))
    except (SetupError, ValueError) as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return EXIT_SETUP
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        monitor.start()
        print(f"monitor of run {cfg.swarm.run_id} at {monitor.url} (JSON: {monitor.url}api/swarm)", flush=True)
        stop.wait()
    except JoinError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return EXIT_JOIN
    except (OSError, ValueError) as e:  # the port is taken, an address does not parse
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return EXIT_SETUP
    finally:
        monitor.stop()
    return 0
