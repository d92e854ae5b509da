"""The folders of ``peer/`` are layers (peer/__init__.py): each imports only the layers below it, and the pure
ones import no networking; ``bootstrap/`` imports only the modules of ``peer/`` docs/architecture.md's Layout
table names. A newcomer can trust the folder names; this test keeps them true."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PEER = Path(__file__).resolve().parents[1] / "peer"
SHARED = {"config", "util", "errors", "proto"}  # every layer may import these
ALLOWED = {
    "local": SHARED,
    "outer": SHARED,
    "net": SHARED | {"outer"},
    "control": SHARED,
    "run": SHARED | {"local", "outer", "net", "control"},
    "monitor": SHARED | {"net"},
    "cli": SHARED | {"run", "control", "monitor"},
}
# Files allowed one more layer: `swarm-peer prepare-data` is a local job (text -> token shards), no run.
EXTRA = {"cli/prepare_data.py": {"local"}}
# Modules that are pure policy or pure math: no hivemind, no sockets, no asyncio.
# Checked on each module's own imports: one may still import a shared module (peer.util has asyncio helpers).
PURE = ["outer", "local", "net/policy", "net/trust/records.py", "net/trust/exclusion.py", "net/trust/span_checks.py",
        "net/view/attendance.py", "net/view/activity.py", "run/pace.py", "run/ledger.py", "run/throughput.py",
        "control/controls.py", "control/limits.py", "control/feed.py", "monitor/view.py"]
NETWORKING = ("hivemind", "socket", "asyncio", "grpc")


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if node.module == "peer")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def layer_of(module: str) -> str:
    """``peer.net.swarm`` -> ``net``; ``peer.config`` -> ``config``."""
    return module.split(".")[1]


def test_every_layer_imports_only_the_layers_below_it():
    wrong = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((PEER / layer).rglob("*.py")):  # (subfolders too: peer/net/plumbing/, ...)
            for module in imports(path):
                extra = EXTRA.get(str(path.relative_to(PEER)), set())
                if module.startswith("peer.") and layer_of(module) not in allowed | extra | {layer}:
                    wrong.append(f"{path.relative_to(PEER.parent)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_pure_modules_import_no_networking():
    paths = [p for entry in PURE for p in ([PEER / entry] if entry.endswith(".py") else (PEER / entry).rglob("*.py"))]
    assert all(p.exists() for p in paths), [str(p) for p in paths if not p.exists()]
    assert len(paths) > 10
    wrong = [f"{p.relative_to(PEER.parent)} imports {m}" for p in paths for m in imports(p)
             if m.split(".")[0] in NETWORKING]
    assert not wrong, "\n".join(wrong)


def test_shared_modules_import_no_layer():
    for name in ("util.py", "errors.py"):
        assert not [m for m in imports(PEER / name) if m.startswith("peer.")], name
    for path in sorted((PEER / "config").glob("*.py")):  # the settings import nothing of peer but themselves
        assert not [m for m in imports(path) if m.startswith("peer.") and layer_of(m) != "config"], path.name


def test_bootstrap_imports_only_what_the_layout_table_says():
    """The ``bootstrap/`` row of docs/architecture.md's Layout table lists the modules of ``peer/`` it may import:
    bootstrap/ imports no other (type-only and function-level imports too), and each one listed is imported."""
    row = next(line for line in (PEER.parent / "docs" / "architecture.md").read_text().splitlines()
               if line.startswith("| `bootstrap/` |"))
    listed = set(re.findall(r"`(peer\.[\w.]+)`", row.split("|")[3]))
    graph = module_graph()
    imported = {m for name, deps in graph.items() if name.split(".")[0] == "bootstrap" for m in deps
                if m.split(".")[0] == "peer"}
    assert imported == listed, {"imported, not in the table": sorted(imported - listed),
                                "in the table, not imported": sorted(listed - imported)}


# Import cycles allowed: none (the round runner reads the swarm through round_runner.SwarmView).
KNOWN_CYCLES: list[set[str]] = []


def module_graph() -> dict[str, set[str]]:
    """{module: the modules of peer/ and bootstrap/ it imports (anywhere in the file, type-only imports too)}."""
    root = PEER.parent
    paths = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in ("peer", "bootstrap") for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & paths.keys()
                out |= subs or ({node.module} & paths.keys())
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names} & paths.keys()
        graph[name] = out - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]  # (the finder finds)
    found = cycles(module_graph())
    assert sorted(map(sorted, found)) == sorted(map(sorted, KNOWN_CYCLES)), found


MAX_MODULE_DOC_LINES = 15  # a module's contract and invariants; the reasons and the numbers live in docs/


def test_every_module_says_what_it_is_for_in_a_short_docstring():
    """Each module of peer/ and bootstrap/ opens with a docstring of at most MAX_MODULE_DOC_LINES lines."""
    long, missing = [], []
    for path in sorted([*PEER.rglob("*.py"), *(PEER.parent / "bootstrap").glob("*.py")]):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc is None:
            if path.name not in ("__main__.py",) and path.stat().st_size > 200:
                missing.append(str(path.relative_to(PEER.parent)))
        elif len(doc.strip().splitlines()) > MAX_MODULE_DOC_LINES:
            long.append(f"{path.relative_to(PEER.parent)}: {len(doc.strip().splitlines())} lines")
    assert not long and not missing, {"too long": long, "none": missing}
