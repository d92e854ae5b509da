"""``swarm-peer status | pause | resume | finish | limits | top --run-dir R``: the owner's controls of a running
peer, through its local control API (peer/control/); ``top`` is the live dashboard (peer/cli/top.py). Human
output by default, ``--json`` for scripts. Exit status: 0 done, 1 the peer refused or did not answer, 2 bad
input (a limit out of range) or no peer in that run dir.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from peer.config import RunConfig, default_of
from peer.control.client import DEFAULT_TIMEOUT, ControlClient, ControlError, describe_held_out
from peer.control.limits import Limits, describe_limits
from peer.proto import control_pb2 as pb

COMMANDS = ("status", "pause", "resume", "finish", "limits", "top")
EXIT_REFUSED, EXIT_USAGE = 1, 2


def add_parsers(sub) -> None:
    helps = {"status": "how a running peer is doing", "pause": "pause training (the peer stays in the swarm's view)",
             "resume": "resume a paused peer", "finish": "complete the rounds in flight, checkpoint and exit",
             "limits": "show or change a running peer's resource limits"}
    for name in COMMANDS[:-1]:
        p = sub.add_parser(name, help=helps[name], description=helps[name].capitalize() + " (local control API).")
        p.add_argument("--run-dir", default=default_of(RunConfig, "run_dir"), help="the peer's run dir")
        p.add_argument("--json", action="store_true", help="print the reply as JSON")
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds to wait for the peer's answer")
        if name in ("pause", "finish"):
            p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                           help="wait up to this long until the peer is paused (pause) or has exited (finish)")
        if name == "limits":
            p.add_argument("--duty-cycle", type=int, help="percent of wall time spent training (1..100)")
            p.add_argument("--threads", type=int, help="CPU threads of the inner step (0 = torch's default)")
            p.add_argument("--active-hours", help="daily window HH:MM-HH:MM in local time (\"\" = always)")
            p.add_argument("--upload-mbps", type=float, help="cap on all-reduce and state uploads, Mbit/s (0 = none)")
            p.add_argument("--download-mbps", type=float, help="the same for downloads, Mbit/s (0 = none)")
    p = sub.add_parser("top", help="live dashboard of a running peer", description="Live terminal dashboard of a "
                       "running peer (local control API). Keys: p pause, r resume, f finish, q quit.")
    p.add_argument("--run-dir", default=default_of(RunConfig, "run_dir"), help="the peer's run dir")
    p.add_argument("--refresh", type=float, default=1.0, help="seconds between two updates")


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def as_plain(message) -> dict:
    """A reply as JSON-ready values: the proto field names, enums by name, 64-bit integers as numbers (the proto
    JSON mapping writes them as strings, which scripts would have to convert)."""
    out = json_format.MessageToDict(message, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True)
    return _numbers(message.DESCRIPTOR, out)


def _numbers(desc, values: dict) -> dict:
    for f in desc.fields:
        if f.name not in values:
            continue
        v = values[f.name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            if f.message_type.fields_by_name["value"].type in _INT64:
                values[f.name] = {k: int(x) for k, x in v.items()}
        elif f.message_type is not None:
            values[f.name] = [_numbers(f.message_type, x) for x in v] if f.is_repeated else _numbers(f.message_type, v)
        elif f.type in _INT64:
            values[f.name] = [int(x) for x in v] if f.is_repeated else int(v)
    return values


def _print(reply, as_json: bool, text: str) -> None:
    print(json.dumps(as_plain(reply)) if as_json else text)


def describe_status(s: pb.StatusReply) -> str:
    state = pb.PeerState.Name(s.state).lower()
    rounds = ", ".join(f"{k} {v}" for k, v in sorted(s.rounds_by_status.items())) or "none yet"
    loss = "-" if math.isnan(s.loss) else f"{s.loss:.4f}"
    lines = [f"peer {s.peer_id} ({state}{': ' + s.detail if s.detail else ''})",
             f"  step {s.step}, loss {loss}, {s.tokens_per_second:.0f} tok/s on {s.device}, tau {s.tau}",
             f"  shared model, held-out loss: {describe_held_out(s)}",
             f"  peers: {s.live_peers} live, {s.paused_peers} paused; next sync: {s.next_sync}",
             f"  rounds: {rounds}; up {s.bytes_up} B, down {s.bytes_down} B",
             f"  limits: {describe_limits(s.limits)}"]
    lines += [f"  fragment {f.index}: round {f.round}, digest {f.digest[:12]}" for f in s.fragments]
    if s.excluded_peers:
        lines.append(f"  excluded peers: {', '.join(s.excluded_peers)}")
    return "\n".join(lines)


def _limit_changes(ns: argparse.Namespace) -> dict:
    """The limits named on the command line (None: not given)."""
    return {k: getattr(ns, k) for k in ("duty_cycle", "threads", "active_hours", "upload_mbps", "download_mbps")}


def run(ns: argparse.Namespace) -> int:
    if ns.command == "top":
        from peer.cli import top  # textual, only when the dashboard is wanted

        return top.run(ns)
    if ns.command == "limits":
        try:  # checked here too, so a typo gets one line before anything is sent
            Limits(**{k: v for k, v in _limit_changes(ns).items() if v is not None})
        except ValueError as e:
            print(f"swarm-peer: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    try:
        with ControlClient(ns.run_dir, timeout=ns.timeout) as client:
            return _run(client, ns)
    except ControlError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return EXIT_USAGE if "no peer is running" in str(e) else EXIT_REFUSED


def _run(client: ControlClient, ns: argparse.Namespace) -> int:
    if ns.command == "status":
        reply = client.status()
        _print(reply, ns.json, describe_status(reply))
        return 0
    if ns.command == "limits":
        reply = client.set_limits(**_limit_changes(ns))
        _print(reply, ns.json, f"limits: {describe_limits(reply.limits)}")
        return 0
    reply = getattr(client, ns.command)()
    _print(reply, ns.json, reply.message)
    if getattr(ns, "wait", 0) > 0:
        return _wait(client, ns)
    return 0


def _wait(client: ControlClient, ns: argparse.Namespace) -> int:
    """``--wait``: until the peer is paused (pause) or gone (finish), polling its status."""
    deadline = time.monotonic() + ns.wait
    while time.monotonic() < deadline:
        try:
            state = client.status().state
        except ControlError:
            if ns.command == "finish":
                print("the peer has exited", file=sys.stderr)
                return 0
            raise
        if ns.command == "pause" and state == pb.PAUSED:
            print("the peer is paused", file=sys.stderr)
            return 0
        time.sleep(0.5)  # (a poll of another process's state; bounded by the deadline)
    print(f"swarm-peer: error: the peer did not {'pause' if ns.command == 'pause' else 'exit'} within {ns.wait:.0f} s",
          file=sys.stderr)
    return EXIT_REFUSED
