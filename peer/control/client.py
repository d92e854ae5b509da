"""A client of a running peer's control API (``swarm-peer status|pause|resume|finish|limits``, the Docker health
check): finds the endpoint and token in ``<run_dir>/control.json`` and calls with a deadline.

Errors a user can act on are :class:`ControlError` with one line: no peer running in that run dir, a peer that
does not answer, a limit it refused.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterator, Optional

import grpc

from peer.control.server import ENDPOINT_FILE
from peer.proto import control_pb2 as pb
from peer.proto import control_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT = 10.0  # seconds per call: handlers answer at once; only a stuck process takes longer


class ControlError(RuntimeError):
    """A control call that could not be made or was refused, in one line."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class ControlClient:
    """Talks to the peer that runs in ``run_dir``. Use as a context manager, or call :meth:`close`."""

    def __init__(self, run_dir: str | Path, timeout: float = DEFAULT_TIMEOUT):
        self.run_dir, self.timeout = Path(run_dir), timeout
        path = self.run_dir / ENDPOINT_FILE
        try:
            endpoint = json.loads(path.read_text())
            self.address, token, pid = str(endpoint["address"]), str(endpoint["token"]), int(endpoint.get("pid", 0))
        except FileNotFoundError:
            raise ControlError(f"no peer is running in {self.run_dir} (no {ENDPOINT_FILE}; start one with "
                               f"swarm-peer run --run-dir {self.run_dir})") from None
        except PermissionError:
            raise ControlError(f"{path}: not readable by this user (run as the peer's owner)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ControlError(f"{path}: unreadable ({e}); is a peer running there?") from None
        if pid and not _alive(pid):
            raise ControlError(f"no peer is running in {self.run_dir} (process {pid} is gone; it was stopped or "
                               f"killed)")
        self._metadata = (("authorization", token),)
        self._channel = grpc.insecure_channel(self.address)
        self._stub = pb_grpc.PeerControlStub(self._channel)

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request, timeout: Optional[float] = None):
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise ControlError(f"the peer in {self.run_dir} does not answer on {self.address} (stopped?)") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ControlError(f"the peer in {self.run_dir} did not answer within {timeout or self.timeout:.0f} s")
            details = e.details() if hasattr(e, "details") else str(e)
            raise ControlError(f"{method}: {details}") from None

    def status(self) -> pb.StatusReply:
        return self._call("Status", pb.StatusRequest())

    def pause(self) -> pb.ControlReply:
        return self._call("Pause", pb.PauseRequest())

    def resume(self) -> pb.ControlReply:
        return self._call("Resume", pb.ResumeRequest())

    def finish(self) -> pb.ControlReply:
        return self._call("Finish", pb.FinishRequest())

    def set_limits(self, **changes) -> pb.LimitsReply:
        """Changes the given limits (the fields of ``SetLimitsRequest``; None keeps one)."""
        request = pb.SetLimitsRequest(**{k: v for k, v in changes.items() if v is not None})
        return self._call("SetLimits", request)

    def watch(self, backlog: int = 0) -> Iterator[dict]:
        """The peer's events as dicts, as they happen (iterate; close the client to stop)."""
        try:
            for event in self._stub.WatchEvents(pb.WatchRequest(backlog=backlog), metadata=self._metadata):
                yield json.loads(event.json)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE):
                raise ControlError(f"WatchEvents: {e.details()}") from None


def describe_held_out(s: pb.StatusReply) -> str:
    """The shared model's held-out loss of a status, in words ("-" before the first evaluation)."""
    if s.eval_round == 0 or math.isnan(s.eval_loss):
        return "-"
    return f"{s.eval_loss:.4f}, perplexity {s.eval_perplexity:.2f} (round {s.eval_round})"
