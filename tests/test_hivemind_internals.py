"""hivemind's private names we rely on (peer/net/plumbing/hivemind_internals.py) still exist: a hivemind upgrade that
renames one fails here, not in a swarm; and no other module of peer/ or bootstrap/ uses one it does not list."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import re
import textwrap
import time
from pathlib import Path
from typing import Iterator, Optional

from peer.net.plumbing.hivemind_internals import IN_SUBCLASSES, PRIVATE

ROOT = Path(__file__).resolve().parents[1]


def _has(obj, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if inspect.isclass(obj):  # an instance attribute: assigned in __init__ or a classmethod that builds it
        source = "".join(inspect.getsource(c) for c in obj.__mro__ if c.__module__.startswith("hivemind"))
        return re.search(rf"(self|\w+)\.{re.escape(name)}\b[^=\n]*=", source) is not None
    return False


def test_every_private_name_we_use_is_still_there():
    missing = []
    for module_name, names in [*PRIVATE.items(), *IN_SUBCLASSES.items()]:
        module = importlib.import_module(module_name)
        for dotted in names:
            owner, _, attr = dotted.rpartition(".")
            obj = getattr(module, owner) if owner else module
            if not _has(obj, attr):
                missing.append(f"{module_name}.{dotted}")
    assert not missing, missing


def test_the_project_touches_hivemind_private_names_only_there():
    """No module of peer/ or bootstrap/ but hivemind_internals reaches into ``_client`` or the other names."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = ("._client", "FORCE_REACHABILITY_MAPPING", "receive_raw_data =", "protocol.DHTLocalStorage",
             "record_validator, \"_validators\"")
    offenders = [f"{p.relative_to(root)}: {n}" for p in [*root.glob("peer/**/*.py"), *root.glob("bootstrap/*.py")]
                 if p.name != "hivemind_internals.py" for n in names if n in p.read_text()]
    assert not offenders, offenders


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def hivemind_private_names() -> set[str]:
    """Every ``_name`` hivemind's sources define: functions, classes, methods, attributes and variables (its
    generated ``*_pb2`` modules aside)."""
    import hivemind

    names = set()
    for path in Path(hivemind.__file__).parent.rglob("*.py"):
        if path.name.endswith("_pb2.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return set(filter(_private, names))


def _dotted(expr: ast.expr) -> Optional[str]:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return head and f"{head}.{expr.attr}"
    return None


def _hivemind_base(cls: ast.ClassDef, tree: ast.Module) -> Optional[type]:
    """The hivemind class ``cls`` subclasses, if any (its base's name resolved through the file's imports)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                          for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    for base in cls.bases:
        head, _, rest = (_dotted(base) or "").partition(".")
        full = ".".join(filter(None, [names.get(head, head), rest]))
        if full.split(".")[0] == "hivemind":
            module, _, name = full.rpartition(".")
            return getattr(importlib.import_module(module), name)
    return None


def _hivemind_members(cls: type) -> tuple[set[str], set[str]]:
    """(the methods and class attributes, the instance attributes: ``self.x = ``) that the hivemind classes of
    ``cls``'s MRO define in their source."""
    members, state = set(), set()
    for c in cls.__mro__:
        if not c.__module__.startswith("hivemind"):
            continue
        node = ast.parse(textwrap.dedent(inspect.getsource(c))).body[0]
        assert isinstance(node, ast.ClassDef)
        for statement in node.body:
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.add(statement.name)
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                members.update(t.id for t in targets if isinstance(t, ast.Name))
        state.update(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                     and isinstance(n.value, ast.Name) and n.value.id == "self")
    return members, state


def _listed() -> set[tuple[type, str]]:
    """(class, attribute) for each entry of IN_SUBCLASSES: what our subclasses may override or use."""
    out = set()
    for module_name, names in IN_SUBCLASSES.items():
        for dotted in names:
            owner, _, attr = dotted.rpartition(".")
            obj = getattr(importlib.import_module(module_name), owner) if owner else None
            if inspect.isclass(obj):
                out.add((obj, attr))
    return out


def private_uses(path: Path, private: set[str], listed: set[tuple[type, str]]) -> Iterator[str]:
    """What ``path`` touches of hivemind's that is private, but for the (class, name) pairs ``listed`` in subclasses:

    - ``x._name`` and the string ``"_name"`` (``getattr``, a pickled state) for a private name of hivemind's,
      where ``x`` is not ``self`` or ``cls`` (``super()._name`` is checked as ``self``'s);
    - in a subclass of a hivemind class: a method that overrides a private one, ``self._name`` of a private
      name its hivemind bases define, ``self.name`` of an instance attribute they set (undocumented state).
    """
    tree = ast.parse(path.read_text())
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    subclasses: dict[ast.AST, tuple[type, set[str], set[str], set[str]]] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        base = _hivemind_base(cls, tree)
        if base is not None:
            own = {s.name for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
            allowed = {attr for owner, attr in listed if issubclass(base, owner)}
            subclasses[cls] = (base, *_hivemind_members(base), allowed)
            for name in own:
                if _private(name) and name in subclasses[cls][1] and name not in allowed:
                    yield f"{where}: {cls.name}.{name} overrides {base.__name__}.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private:
            yield f"{where}:{node.lineno}: {node.value!r}"
        if not isinstance(node, ast.Attribute):
            continue
        on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") or (
            isinstance(node.value, ast.Call) and _dotted(node.value.func) == "super")
        if not on_self:
            if node.attr in private:
                yield f"{where}:{node.lineno}: {ast.unparse(node)}"
            continue
        cls = next((c for c in subclasses if any(n is node for n in ast.walk(c))), None)
        if cls is None:
            continue
        base, members, state, allowed = subclasses[cls]
        if node.attr in allowed:
            continue
        if _private(node.attr) and node.attr in members | state or (
                not _private(node.attr) and node.attr in state - members and not hasattr(base, node.attr)):
            yield f"{where}:{node.lineno}: {ast.unparse(node)} ({base.__name__}'s)"


def _sources() -> list[Path]:
    return [p for p in sorted([*ROOT.glob("peer/**/*.py"), *ROOT.glob("bootstrap/**/*.py")])
            if p.name != "hivemind_internals.py" and not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def test_no_module_but_hivemind_internals_uses_a_private_name_of_hivemind_unlisted():
    """Every private name of hivemind's that peer/ and bootstrap/ use goes through a function of hivemind_internals,
    and every override of a private method or use of a hivemind class's undocumented state in a subclass is an
    entry of its IN_SUBCLASSES."""
    private, listed = hivemind_private_names(), _listed()
    assert {"_remove_outdated", "_public_key", "_request_join_group", "_client"} <= private  # (the scan sees)
    offenders = [use for path in _sources() for use in private_uses(path, private, listed)]
    assert not offenders, "\n".join(offenders)


def test_the_private_name_scan_finds_each_kind_of_use(tmp_path: Path):
    """What the scan above would have caught: each private use hivemind_internals now wraps or lists."""
    sample = tmp_path / "sample.py"
    sample.write_text(textwrap.dedent("""
        import hivemind
        from hivemind.averaging.matchmaking import Matchmaking
        from hivemind.dht.storage import DHTLocalStorage

        class M(Matchmaking):
            async def _request_join_group(self, leader):
                return await super()._request_join_group(leader)

        class S(DHTLocalStorage):
            def used(self):
                self._remove_outdated()

        class D(hivemind.DHT):
            def run(self):
                print(self.kwargs)

        def der(public_key):
            return public_key._public_key

        key = {"_private_key": b""}
    """))
    found = list(private_uses(sample, hivemind_private_names(), set()))
    for expected in ("M._request_join_group overrides", "super()._request_join_group", "self._remove_outdated",
                     "self.kwargs", "public_key._public_key", "'_private_key'"):
        assert any(expected in use for use in found), (expected, found)


def test_the_dht_process_reads_a_message_whole_when_it_arrives_in_two_writes():
    """hivemind's DHT process reads its pipe without blocking as soon as its poll sees bytes; Python writes a
    message over 16 KiB as a header, then the body. A read between the two raised BlockingIOError and killed the
    DHT process; read_whole_messages makes that read wait for the body."""
    import multiprocessing as mp
    import os
    import pickle
    import struct
    import threading

    from peer.net.plumbing.hivemind_internals import _WholeMessages

    message = ("_store", [], {"value": b"x" * 30_000})  # (over 16 KiB, under what a pipe buffers)
    body = pickle.dumps(message)

    def half_written(reader, writer) -> threading.Timer:
        os.set_blocking(reader.fileno(), False)  # (as the DHT process's event loop leaves it)
        assert not reader.poll()
        os.write(writer.fileno(), struct.pack("!i", len(body)))  # the header now, the body a moment later
        assert reader.poll(5)
        fd = writer.fileno()
        timer = threading.Timer(0.3, lambda: os.write(fd, body))
        timer.start()
        return timer

    reader, writer = mp.Pipe(duplex=False)
    timer = half_written(reader, writer)
    try:
        reader.recv()
        raise AssertionError("a non-blocking read of a half-written message did not fail: nothing to fix")
    except BlockingIOError:
        pass
    timer.join()
    reader, writer = mp.Pipe(duplex=False)
    whole = _WholeMessages(reader)
    timer = half_written(whole, writer)
    assert whole.recv() == message  # (waits the 0.3 s for the body)
    timer.join()
    assert not os.get_blocking(reader.fileno())  # (left as the event loop set it)


def test_threads_that_store_large_values_at_once_do_not_corrupt_the_dht_pipe():
    """hivemind's DHT methods send on one pipe from whichever thread calls them, a message over 16 KiB in two
    writes: two threads storing 1 MiB values at once interleaved their bytes and the DHT process died on the
    corrupt message. send_whole_messages lets one message through at a time: the process lives and answers."""
    import threading

    from hivemind.utils import get_dht_time

    from peer.net.plumbing.dht import create_dht

    dht = create_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], identity_path=None,
                     client_mode=False)
    big = {"pad": "x" * (1 << 20)}  # (each refused by the node's storage bounds: only the pipe is tested)
    answered = threading.Event()

    def stores(tag: str) -> None:
        for i in range(20):
            dht.store(f"key-{tag}", big, get_dht_time() + 60, subkey=b"s%d" % i, return_future=True)

    def work() -> None:  # (a dead DHT process leaves senders blocked on a full pipe: the test waits with a deadline)
        threads = [threading.Thread(target=stores, args=(tag,), daemon=True) for tag in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert dht.store("small", 1, get_dht_time() + 60, return_future=True).result(timeout=30)
        assert dht.get("small", latest=True, return_future=True).result(timeout=30).value == 1
        answered.set()

    threading.Thread(target=work, daemon=True).start()
    try:
        assert answered.wait(90), "the DHT process stopped answering: its pipe was corrupted"
        assert dht.is_alive()
    finally:
        if answered.is_set():
            dht.shutdown()
        else:
            dht.kill()


def test_a_request_handler_is_forgotten_however_it_ends():
    """Two real daemons: a request whose caller gives up (it cancels the call; the daemon tells the handler's side,
    which cancels the handler) leaves nothing in the handler side's table, nor does one answered; hivemind kept a
    cancelled handler there for good, with the request's bytes (``forget_ended_handlers``)."""
    from hivemind.proto import dht_pb2

    from helpers import p2p_mesh
    from peer.net.plumbing.hivemind_internals import forget_ended_handlers

    forget_ended_handlers()
    started, ended, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handler(request: dht_pb2.PingRequest, context) -> dht_pb2.PingResponse:
        started.set()
        try:
            await release.wait()
            return dht_pb2.PingResponse(available=True)
        finally:
            ended.set()

    async def until(cond) -> bool:  # (the daemon forwards the cancellation: a few messages)
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return cond()

    async def run() -> None:
        server, client = await p2p_mesh(2)
        try:
            await server.add_protobuf_handler("test.hold", handler, dht_pb2.PingRequest)
            table = server._client.control._handler_tasks
            call = asyncio.create_task(client.call_protobuf_handler(
                server.peer_id, "test.hold", dht_pb2.PingRequest(), dht_pb2.PingResponse))
            await asyncio.wait_for(started.wait(), 10)
            call.cancel()
            assert await until(ended.is_set)  # (the handler was cancelled)
            assert await until(lambda: not table), table
            started.clear()
            release.set()
            answered = await asyncio.wait_for(client.call_protobuf_handler(
                server.peer_id, "test.hold", dht_pb2.PingRequest(), dht_pb2.PingResponse), 10)
            assert answered.available and await until(lambda: not table), table
        finally:
            for p in (server, client):
                await p.shutdown()

    asyncio.run(run())
