"""swarmloco bootstrap node: ``swarm-bootstrap`` (also ``python -m bootstrap``).

A DHT-only node that peers join through; it holds no model and runs no training.

Map of the code:

* ``bootstrap/cli.py`` -- flags (each with a ``SWARM_<FLAG>`` environment twin), startup, the one stdout line
  ``--initial-peers MADDR ...`` to paste into other nodes' command lines, periodic routing-table status on
  stderr, clean shutdown on SIGINT/SIGTERM (exit 0, no p2pd left behind). Bad flag values exit 2.
* ``bootstrap/__main__.py`` -- ``python -m bootstrap``.
* The DHT itself is created by ``peer/net/plumbing/dht.py`` (shared with the peer daemon): network-safety defaults
  (no NAT port mapping unless ``--nat-port-map``), paste line; identity files and multiaddr validation are
  ``peer/net/plumbing/addresses.py``'s.
"""
