"""Local training: the model (``model``), this peer's data (``data``) and the inner AdamW loop (``inner``).

Knows nothing of the swarm. May import: ``peer.config``, ``peer.util``.
"""
