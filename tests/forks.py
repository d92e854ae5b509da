"""Peer and bootstrap processes forked from a process that has already imported them (the tests' "zygote").

A peer's start costs about as much CPU as 160 training steps, half of it imports (torch, hivemind,
``torch._dynamo``) and numba's codec kernels; a swarm test starts dozens of peers on two cores. The zygote
(``python tests/forks.py``, one per test process, started on first use) imports all of it once, then forks one
child per request. The child is what ``python -m MODULE ARGS`` would be, minus the imports: its own session
(``setsid``), stdout and stderr appended to the log, stdin from /dev/null, the requested cwd and network
namespace (``setns``, as ``ip netns exec`` does), then ``runpy`` runs ``MODULE.__main__`` with ``sys.argv`` set,
and the interpreter exits as it would (``atexit``, thread joins). Children are real processes with their own
p2pd and DHT processes, so signals, ``kill -9`` and sessions behave as with ``subprocess``.

Contract: a request is forked only where its environment equals the zygote's but for ``VOLATILE`` (variables read
at import, such as ``HIVEMIND_LOGLEVEL``, are already applied); ``Proc.start`` runs anything else through
``subprocess``. Forking is safe for the same reason the peer's own DHT fork is: no thread of the zygote holds a
lock then (the codec kernels' lock is taken around ``fork``; OpenBLAS re-creates its pool). The zygote reaps its
children and reports every exit code; it ends when the tests' process closes its pipe.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Mapping, Optional, Sequence

MODULES = ("peer", "bootstrap")  # what ``python -m`` commands the zygote can become
# Variables a request's environment may set apart from the zygote's: nothing reads them at import (pytest names
# the running test in the first)
VOLATILE = ("PYTEST_CURRENT_TEST",)
REPLY_S = 180.0  # how long a request may wait for its fork (the first one waits for the zygote's imports)
CLOSE_S = 10.0


# ---- the zygote (its own process) ------------------------------------------------------------------------------

def _preload() -> None:
    """Everything a peer or a bootstrap node imports at its start, and the codec kernels (compiled, or loaded
    from numba's cache). Nothing here may start a Python thread or draw from torch's generator."""
    import bootstrap.cli  # noqa: F401
    import peer.cli.swarm_peer  # noqa: F401
    import peer.run.trainer  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it on a peer's first optimizer)
    from peer.outer import cpu_path

    cpu_path.kernels()


def _send(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _enter_netns(name: str) -> None:
    """Joins the network namespace ``ip netns add NAME`` made (before any thread exists, so all of them do)."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, os.CLONE_NEWNET)
    else:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    os.close(fd)


def _become(request: dict, inherited: Sequence[int]) -> None:
    """In the forked child: become ``python -m MODULE ARGV``. Never returns (the module's exit raises)."""
    os.setsid()
    for fd in inherited:
        os.close(fd)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)  # from here on, a failure's traceback goes to the log, as ``ip netns exec``'s errors did
    os.close(log)
    os.close(null)
    if request["netns"]:
        _enter_netns(request["netns"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])  # (differs from the zygote's in VOLATILE only)
    import runpy

    import numpy as np

    np.random.seed()  # a new interpreter seeds numpy's global generator afresh (``random`` reseeds at fork)
    sys.path[0] = os.getcwd()  # as ``-m`` puts it
    sys.argv = ["-m", *request["argv"]]  # (runpy sets argv[0] to the module's path)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve() -> None:
    """Reads requests (JSON lines) on fd 0, forks, and writes ``{"id", "pid"}`` then ``{"exit", "code"}`` on fd
    1. Returns when fd 0 is closed. A child leaves this function only by exiting the interpreter."""
    _preload()
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        ready, _, _ = select.select([0, *children], [], [])
        for fd in ready:
            if fd != 0:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(request, list(children))
                children[os.pidfd_open(pid)] = pid  # (a child that already exited is still a zombie here)
                _send({"id": request["id"], "pid": pid})


# ---- the tests' side -------------------------------------------------------------------------------------------

class Zygote:
    """The tests' handle on one zygote process. ``spawn`` is thread-safe; ``close`` ends the zygote."""

    def __init__(self, env: Mapping[str, str]):
        self.env = dict(env)
        self._errors = tempfile.NamedTemporaryFile(prefix="zygote-", suffix=".log", delete=False)
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._errors, env=self.env, start_new_session=True)
        self._cond = threading.Condition()  # over the replies (the reader thread is their one writer)
        self._write = threading.Lock()  # one request at a time on the pipe (held apart from _cond: a blocked
        # write must not keep the reader from taking replies)
        self._pids: dict[int, int] = {}  # request id -> pid
        self._codes: dict[int, int] = {}  # pid -> exit code
        self._next_id = 0
        self._ended = False
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._cond:
                if "exit" in message:
                    self._codes[message["exit"]] = message["code"]
                else:
                    self._pids[message["id"]] = message["pid"]
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def _failure(self, what: str) -> RuntimeError:
        return RuntimeError(f"the tests' zygote (pid {self._proc.pid}) {what}; its stderr, "
                            f"{self._errors.name}:\n{Path(self._errors.name).read_text()[-4000:]}")

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a command with environment ``env`` may be forked from this zygote."""
        return _fixed(env) == _fixed(self.env)

    def spawn(self, module: str, argv: Sequence[str], *, env: Mapping[str, str], log: Path, cwd: str,
              netns: Optional[str]) -> "Forked":
        """Forks ``python -m module argv`` (see the module's docstring); returns once the child exists. Must only
        be called where ``serves(env)``."""
        with self._write:
            request_id, self._next_id = self._next_id, self._next_id + 1
            assert self._proc.stdin is not None
            request = {"id": request_id, "module": module, "argv": list(argv), "env": dict(env), "log": str(log),
                       "cwd": cwd, "netns": netns}
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._pids or self._ended, REPLY_S):
                raise self._failure(f"did not fork within {REPLY_S:g} s")
            if request_id not in self._pids:
                raise self._failure("ended")
            return Forked(self, self._pids.pop(request_id), [module, *argv])

    def code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """``pid``'s exit code once it has exited, waiting up to ``timeout`` s (0: do not wait); else None."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes or self._ended, timeout)
            if pid not in self._codes and self._ended:
                raise self._failure(f"ended before child {pid} exited")
            return self._codes.get(pid)

    def close(self) -> None:
        """Ends the zygote (its children, if any are left, run on). Idempotent."""
        if self._proc.stdin and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=CLOSE_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=CLOSE_S)
        self._errors.close()
        if self._proc.returncode == 0:  # (else its stderr stays, for whoever looks into it)
            Path(self._errors.name).unlink(missing_ok=True)


def _fixed(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE}


class Forked:
    """A forked child, with the part of ``subprocess.Popen``'s interface the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args

    def poll(self) -> Optional[int]:
        return self.zygote.code(self.pid, 0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self.zygote.code(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def forkable(args: Sequence[str]) -> Optional[tuple[Optional[str], str, list[str]]]:
    """``(netns, module, argv)`` where ``args`` is ``[ip netns exec NAME] python -m MODULE ARGV`` with this
    interpreter and a module of MODULES; else None."""
    args = [str(a) for a in args]
    netns = None
    if len(args) > 4 and Path(args[0]).name == "ip" and args[1:3] == ["netns", "exec"]:
        netns, args = args[3], args[4:]
    if len(args) >= 3 and args[0] == sys.executable and args[1] == "-m" and args[2] in MODULES:
        return netns, args[2], args[3:]
    return None


if __name__ == "__main__":
    serve()
