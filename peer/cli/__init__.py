"""The command line: ``swarm_peer`` (``swarm-peer run``; light to import: it loads the trainer only to run)
and ``demo`` (``make demo``: a bootstrap node, three peers and a summary). May import: ``peer.config``,
``peer.run``.
"""
