"""Docs that point somewhere point at something: every Sphinx role in a docstring of ``peer/`` and ``bootstrap/``
(``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:attr:``, ...) names an object that exists, and every source path
the Markdown docs name (``peer/net/policy/agreement.py``) is a file of the checkout."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`([^`]+)`")
PATH = re.compile(r"\b((?:peer|bootstrap|tests|bench|docker|configs|protos)/[\w./-]+\.(?:py|toml|proto|yml|yaml))\b")


def _modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted([*REPO.glob("peer/**/*.py"), *REPO.glob("bootstrap/**/*.py")]):
        if path.name.endswith("_pb2.py") or path.name == "__main__.py":  # (generated; runs the CLI on import)
            continue
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out.append((path, name.removesuffix(".__init__")))
    return out


def _attribute(owner: object, parts: list[str]) -> bool:
    obj = owner
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif inspect.isclass(obj) and i == len(parts) - 1:  # an instance attribute, set in the class's code
            return re.search(rf"\bself\.{re.escape(part)}\b", inspect.getsource(obj)) is not None
        else:
            return False
    return True


def resolves(target: str, module: ModuleType) -> bool:
    """Whether ``target`` (as written in a role, ``~`` and ``()`` allowed) names an object: a dotted path from an
    importable module, or a name of ``module`` or of one of the classes it defines."""
    parts = target.strip().lstrip("~.").removesuffix("()").split(".")
    for i in range(len(parts), 0, -1):
        try:
            root = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        if _attribute(root, parts[i:]):
            return True
        break
    own = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    return any(_attribute(owner, parts) for owner in [module, *own])


def test_every_docstring_reference_resolves():
    broken = []
    for path, name in _modules():
        module = importlib.import_module(name)
        for m in ROLE.finditer(path.read_text()):
            if not resolves(m.group(1), module):
                broken.append(f"{path.relative_to(REPO)}: {m.group(0)}")
    assert not broken, "references to nothing:\n" + "\n".join(broken)


def test_every_source_path_the_docs_name_exists():
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for m in PATH.finditer(doc.read_text()):
            if not (REPO / m.group(1)).exists():
                missing.append(f"{doc.relative_to(REPO)}: {m.group(1)}")
    assert not missing, "paths that do not exist:\n" + "\n".join(sorted(set(missing)))
