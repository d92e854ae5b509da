"""How ``swarm-bootstrap`` and its ``authority`` subcommands report a bad command line: one line, exit status 2."""

from __future__ import annotations

import argparse

PROG = "swarm-bootstrap"


class UsageError(Exception):
    """A bad flag value; reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` instead of printing the usage and exiting."""

    def error(self, message: str):  # one line instead of usage + error
        raise UsageError(message)
