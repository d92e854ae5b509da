"""``swarm-peer``: the peer daemon's command line.

``swarm-peer run [--config FILE] [flags]`` trains in the swarm; ``swarm-peer pass-request [...]`` prints the line
a volunteer sends the operator of an authenticated run; ``swarm-peer prepare-data INPUT... --out DIR`` tokenizes
text into the shards of ``data.source = "tokens"`` (peer/cli/prepare_data.py); ``swarm-peer export`` and
``swarm-peer sample`` take a run dir's model home or try it out (peer/cli/take_home.py); ``swarm-peer status | pause |
resume | finish | limits | top --run-dir R`` control a running peer (peer/cli/control.py); ``swarm-peer doctor``
checks a machine before it joins (peer/cli/doctor.py); ``swarm-peer monitor`` serves an operator's view of the
run's swarm (peer/cli/monitor.py). Every config field has a flag and an ``SWARM_*`` env-var twin (see
peer/config/sections.py and network.py); invalid input exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from peer.cli import control, doctor, monitor, prepare_data, take_home
from peer.config import SECTIONS, ConfigError, default_of, iter_fields, iter_settings
from peer.config.load import build_config, env_name, flag_name, parse_scalar, unknown_env


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per config field (with its env twin and default in the help)."""
    parser.add_argument("--config", help="TOML config file (sections: " + ", ".join(SECTIONS) + ")")
    fields = {(s, f.name): f for s, f in iter_settings()}
    for section, key, typ in iter_fields():
        group_title = f"[{section}]"
        groups = {g.title: g for g in parser._action_groups}
        group = groups.get(group_title) or parser.add_argument_group(group_title)
        f = fields[(section, key)]
        default = default_of(SECTIONS[section], key)
        local = "; this peer's own choice, not in the run hash" if f.metadata["local"] else ""
        help_text = f"{f.metadata['help']} (env {env_name(section, key)}; default {default!r}{local})"
        dest = f"{section}__{key}"
        if typ is bool:
            group.add_argument(flag_name(section, key), dest=dest, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        elif typ == list[str]:
            group.add_argument(flag_name(section, key), dest=dest, action="extend", nargs="+", default=None,
                               metavar="VALUE", help=help_text)
        else:
            group.add_argument(flag_name(section, key), dest=dest, type=str, default=None,
                               metavar=getattr(typ, "__name__", "VALUE").upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-peer", description="swarmloco peer daemon: trains a shared model "
                                     "with Streaming DiLoCo in a hivemind DHT swarm.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_config_flags(sub.add_parser("run", help="join the swarm and train", description="Join the swarm and train. "
                                     "Flags override the --config TOML file, which overrides defaults; every flag "
                                     "has an env twin."))
    _add_config_flags(sub.add_parser("pass-request", help="print the line to send a run's operator for a pass",
                                     description="Authenticated runs: print this peer's pass request (its peer id "
                                     "and identity key; the identity is created if missing). Send the line to the "
                                     "run's operator and save the pass they return as swarm.pass_path."))
    check = sub.add_parser("doctor", help="check this machine, the config and the swarm before joining",
                           description="Check this machine (versions, device, memory, disk, run dir), the model and "
                           "data, the initial peers, the clock against the swarm's and who trains the run. Takes the "
                           "same config and flags as run.")
    _add_config_flags(check)
    doctor.add_arguments(check)
    watch = sub.add_parser("monitor", help="serve a web page and JSON API of the run's swarm (operators)",
                           description="The operator's view of a run: live peers (version, step, rounds, tokens/s, "
                           "loss, reachability, paused), each fragment's latest round and whether digests agree, "
                           "the swarm's tokens/s and loss, from the peers' signed records. Takes the same config "
                           "and flags as run, to name the run.")
    _add_config_flags(watch)
    monitor.add_arguments(watch)
    prepare_data.add_parser(sub)
    take_home.add_parsers(sub)
    control.add_parsers(sub)
    return parser


def parse_overrides(ns: argparse.Namespace) -> dict[tuple[str, str], object]:
    out = {}
    types = {(s, k): t for s, k, t in iter_fields()}
    for dest, value in vars(ns).items():
        if "__" not in dest or value is None:
            continue
        section, key = dest.split("__", 1)
        typ = types[(section, key)]
        if typ in (int, float) or typ in (int | str, float | str):
            value = parse_scalar(section, key, typ, value)
        elif typ == list[str]:
            value = [item for v in value for item in v.replace(",", " ").split()]
        out[(section, key)] = value
    return out


# Exit status: 0 a clean stop (max_steps, SIGINT/SIGTERM); 2 a setup to fix (config, run dir, device, model,
# data, pass: one line, before joining; or the authority revoked our pass while training); 3 no initial peer
# answered within swarm.join_timeout (one line naming each address); 1 a failure during training (with its
# traceback).
EXIT_SETUP, EXIT_JOIN = 2, 3


def main(argv: Optional[Sequence[str]] = None) -> int:
    import os

    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "prepare-data":  # no config: it only reads and writes files
        return prepare_data.run(ns)
    if ns.command in take_home.COMMANDS:  # the run dir's checkpoint holds the config
        return take_home.run(ns)
    if ns.command in control.COMMANDS:  # the running peer holds the config
        return control.run(ns)
    for warning in unknown_env(dict(os.environ)):
        print(f"swarm-peer: warning: {warning}", file=sys.stderr)
    try:
        overrides = parse_overrides(ns)
        if ns.command == "pass-request":  # only the identity matters here, not where the swarm is
            overrides.setdefault(("swarm", "new_swarm"), True)
        cfg = build_config(ns.config, overrides)
    except ConfigError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return EXIT_SETUP
    if ns.command == "run":
        from peer.errors import JoinError, SetupError
        from peer.run import preflight

        try:
            preflight.check_data_files(cfg)  # before the trainer's imports (seconds of CPU): a wrong path at once
            from peer.run.trainer import Trainer  # heavy imports only when we really run

            return Trainer(cfg).run()
        except (SetupError, ConfigError) as e:  # ConfigError: a file the run hash covers cannot be read
            print(f"swarm-peer: error: {e}", file=sys.stderr)
            return EXIT_SETUP
        except JoinError as e:
            print(f"swarm-peer: error: {e}", file=sys.stderr)
            return EXIT_JOIN
    if ns.command == "pass-request":
        return _pass_request(cfg)
    if ns.command == "doctor":
        return doctor.run(cfg, ns)
    if ns.command == "monitor":
        return monitor.run(cfg, ns)
    return EXIT_SETUP


def _pass_request(cfg) -> int:
    from peer.errors import SetupError
    from peer.run.preflight import pass_request_line

    try:
        line = pass_request_line(cfg)
    except SetupError as e:
        print(f"swarm-peer: error: {e}", file=sys.stderr)
        return EXIT_SETUP
    print(line)
    print(f"(send the line above to the run's operator; save the pass they return as {cfg.pass_path}, "
          f"or point swarm.pass_path at it)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
