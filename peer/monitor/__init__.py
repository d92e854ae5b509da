"""The operator's monitor of a run's swarm (``swarm-peer monitor``)."""
