"""One peer's run: ``trainer`` (the one place that composes local training, the outer engine and the swarm),
``outcomes`` (what a round's outcome changes outside the engine), ``checkpoint`` (atomic, checksummed), ``events``
(JSON events, logging), ``status`` (the status line), ``figures`` (what the owner sees, from two threads),
``run_dir`` (one process per run dir), ``preflight`` (checks before joining), ``owner`` (the control API and the
limits, seen from the loop) and ``export`` (the model taken home).
May import every layer below it: ``peer.local``, ``peer.outer``, ``peer.net``, ``peer.control``, ``peer.config``,
``peer.util``.
"""
