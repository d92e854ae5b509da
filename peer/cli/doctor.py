"""``swarm-peer doctor [--config FILE] [flags]``: the checklist a volunteer runs before joining (peer/run/doctor.py),
with the same config and flags as ``swarm-peer run``. Exit status 0 when every check passed (warnings allowed),
1 when one failed, 2 for a config that does not parse."""

from __future__ import annotations

import argparse
import json

from peer.config import PeerConfig

MARK = {"ok": " ok ", "warn": "warn", "fail": "FAIL"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-network", action="store_true", help="only the checks of this machine")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds for each network check")


def run(cfg: PeerConfig, ns: argparse.Namespace) -> int:
    from peer.run.doctor import Check, run_checks, summary  # torch: only when the doctor runs

    def show(check: Check) -> None:
        if not ns.json:
            print(f"[{MARK[str(check.verdict)]}] {check.name}: {check.found}", flush=True)
            if check.fix:
                print(f"       fix: {check.fix}", flush=True)

    checks = run_checks(cfg, network=not ns.no_network, timeout=ns.timeout, on_check=show)
    code, line = summary(checks)
    if ns.json:
        print(json.dumps({"ok": code == 0, "summary": line,
                          "checks": [dict(name=c.name, verdict=str(c.verdict), found=c.found, fix=c.fix)
                                     for c in checks]}))
    else:
        print(line)
    return code
