"""The local control API (``protos/control.proto``) served by a running peer with gRPC, for its owner only.

Endpoint: a unix socket ``<run_dir>/control.sock`` (mode 0600), or ``127.0.0.1:<port>`` when the run dir's path is
too long for a socket address. Either way the peer writes ``<run_dir>/control.json`` (mode 0600, atomically):
the address and a random token, which every call must carry as ``authorization`` metadata. So only a process
that can read the owner's run dir controls the peer, and nothing listens beyond this machine.

Bounds: a few worker threads, small messages, at most ``MAX_WATCHERS`` event streams at once. The handlers only
read a status snapshot and set intents on :class:`~peer.control.controls.Controls`; the training loop acts.
"""

from __future__ import annotations

import dataclasses
import concurrent.futures
import hmac
import json
import logging
import math
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Callable

import grpc

from peer.control.controls import Controls, PeerState
from peer.control.feed import EventFeed
from peer.control.limits import Limits
from peer.proto import control_pb2 as pb
from peer.proto import control_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ENDPOINT_FILE = "control.json"
SOCKET_FILE = "control.sock"
MAX_SOCKET_PATH = 100  # bytes: sun_path holds 108 with its terminator; keep a margin
MAX_WATCHERS = 2
MAX_MESSAGE_BYTES = 64 * 1024  # requests are a few bytes; a status reply a few KB
WORKERS = 4

STATES = {PeerState.STARTING: pb.STARTING, PeerState.TRAINING: pb.TRAINING, PeerState.PAUSING: pb.PAUSING,
          PeerState.PAUSED: pb.PAUSED, PeerState.FINISHING: pb.FINISHING}


def limits_message(limits: Limits) -> pb.Limits:
    return pb.Limits(**{f.name: getattr(limits, f.name) for f in dataclasses.fields(limits)})


class _Servicer(pb_grpc.PeerControlServicer):
    def __init__(self, controls: Controls, status_fn: Callable[[], dict[str, Any]], feed: EventFeed):
        self.controls, self.status_fn, self.feed = controls, status_fn, feed
        self._watchers = threading.BoundedSemaphore(MAX_WATCHERS)

    def Status(self, request, context):
        state, detail = self.controls.state()
        fields = dict(self.status_fn())
        fragments = [pb.FragmentStatus(**f) for f in fields.pop("fragments", [])]
        nan_if_none = {k: math.nan if fields.get(k) is None else float(fields[k])
                       for k in ("loss", "eval_loss", "eval_perplexity")}
        fields = {k: v for k, v in fields.items() if k not in nan_if_none}
        return pb.StatusReply(state=STATES[state], detail=detail, fragments=fragments, **nan_if_none,
                              limits=limits_message(self.controls.limits.get()), **fields)

    def _reply(self, message: str) -> pb.ControlReply:
        return pb.ControlReply(state=STATES[self.controls.state()[0]], message=message)

    def Pause(self, request, context):
        return self._reply(self.controls.pause())

    def Resume(self, request, context):
        return self._reply(self.controls.resume())

    def Finish(self, request, context):
        return self._reply(self.controls.finish())

    def SetLimits(self, request, context):
        changes = {k: getattr(request, k) if request.HasField(k) else None
                   for k in pb.SetLimitsRequest.DESCRIPTOR.fields_by_name}
        try:
            limits = self.controls.set_limits(**changes)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("limits changed by the owner: %s", limits)
        return pb.LimitsReply(limits=limits_message(limits))

    def WatchEvents(self, request, context):
        if not self._watchers.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS} event streams at once")
        active = threading.Event()
        active.set()
        context.add_callback(active.clear)  # the client went away: end the stream
        try:
            for event in self.feed.follow(backlog=min(request.backlog, 1024), active=active):
                yield pb.Event(json=event)
        finally:
            self._watchers.release()


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses every call without the run dir's token (constant-time comparison)."""

    def __init__(self, token: str):
        self._token = token

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"the token of {ENDPOINT_FILE} is required")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token.encode()):
            return continuation(handler_call_details)
        return self._deny


def write_private_json(path: Path, value: dict) -> None:
    """Writes ``value`` as JSON readable by the owner only, atomically (a reader sees the old file or the new)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ControlServer:
    """Serves the control API of one peer. Call :meth:`start` once the run dir is locked by this process (so no
    other peer owns its endpoint), and :meth:`stop` before the process exits."""

    def __init__(self, run_dir: Path, controls: Controls, status_fn: Callable[[], dict[str, Any]], feed: EventFeed):
        self.run_dir = Path(run_dir).resolve()
        self.controls, self.feed = controls, feed
        self._servicer = _Servicer(controls, status_fn, feed)
        self._server: grpc.Server | None = None
        self.address = ""

    def start(self) -> str:
        """Binds the endpoint, writes ``control.json`` and returns the address. Raises OSError if it cannot."""
        token = secrets.token_hex(16)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="control"),
                             interceptors=[_TokenCheck(token)], maximum_concurrent_rpcs=WORKERS * 4,
                             options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
        pb_grpc.add_PeerControlServicer_to_server(self._servicer, server)
        sock = self.run_dir / SOCKET_FILE
        if len(str(sock).encode()) <= MAX_SOCKET_PATH:
            sock.unlink(missing_ok=True)  # left by a peer that was killed (the run-dir lock is ours now)
            address = f"unix:{sock}"
            if not server.add_insecure_port(address):
                raise OSError(f"cannot listen on {sock}")
            os.chmod(sock, 0o600)
        else:
            port = server.add_insecure_port("127.0.0.1:0")
            if not port:
                raise OSError("cannot listen on 127.0.0.1")
            address = f"127.0.0.1:{port}"
        server.start()
        self._server, self.address = server, address
        write_private_json(self.run_dir / ENDPOINT_FILE, {"address": address, "token": token, "pid": os.getpid()})
        log.info("control API on %s (swarm-peer status|pause|resume|finish|limits --run-dir %s)", address,
                 self.run_dir)
        return address

    def stop(self, grace: float = 1.0) -> None:
        """Ends the event streams, stops serving (waiting up to ``grace`` s for calls in progress) and removes the
        endpoint files, so a client finds no peer rather than a dead one."""
        self.feed.close()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1.0)
            self._server = None
        for name in (ENDPOINT_FILE, SOCKET_FILE):
            try:
                (self.run_dir / name).unlink(missing_ok=True)
            except OSError:
                pass
