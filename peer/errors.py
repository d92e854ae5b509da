"""The errors the command line turns into exit statuses (see ``peer/cli/swarm_peer.py``); any layer may raise them.

A failure during training is none of these: it ends the peer with its traceback (status 1).
"""

from __future__ import annotations


class SetupError(ValueError):
    """Something in the user's setup (config, files, run dir, device, model, data) to fix before training:
    one line, exit status 2."""


class JoinError(RuntimeError):
    """No initial peer could be reached within ``join_timeout``; the message names every address and why:
    one line, exit status 3."""
