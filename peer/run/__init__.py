"""One peer's run: ``trainer`` (the one place that composes local training, the outer engine and the swarm),
``checkpoint`` (atomic, checksummed), ``events`` (JSON events, logging), ``status`` (the status line),
``run_dir`` (one process per run dir) and ``preflight`` (checks before joining).
May import every layer below it: ``peer.local``, ``peer.outer``, ``peer.net``, ``peer.config``, ``peer.util``.
"""
