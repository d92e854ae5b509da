"""hivemind's private names we rely on (peer/net/plumbing/hivemind_internals.py) still exist: a hivemind upgrade that
renames one fails here, not in a swarm."""

from __future__ import annotations

import importlib
import inspect

from peer.net.plumbing.hivemind_internals import PRIVATE


def _has(obj, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if inspect.isclass(obj):  # an instance attribute: assigned in __init__ or a classmethod that builds it
        source = "".join(inspect.getsource(c) for c in obj.__mro__ if c.__module__.startswith("hivemind"))
        return f"self.{name} =" in source or f"self.{name}:" in source or f".{name} = " in source
    return False


def test_every_private_name_we_use_is_still_there():
    missing = []
    for module_name, names in PRIVATE.items():
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
