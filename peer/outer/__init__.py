"""The outer algorithm (Streaming DiLoCo, docs/algorithm.md), pure torch: no sockets, no DHT.

``fragments`` (which parameters sync together), ``schedule`` (when), ``state`` (outer state per fragment, the
Nesterov outer step, error feedback), ``rounds`` (what a round produced: status and spans), ``engine`` (launch,
overlap tau, eager updates, merge; ``eager``: our share applied at launch; ``saved_state``: its checkpoint),
``aggregate`` (how a reducer combines parts: mean or the robust rule), ``codec`` (wire formats; FP4 in ``e3m0``,
shared parts in ``wire``), ``simulator`` (M replicas in-process).
May import: ``peer.config``, ``peer.util``, ``peer.proto``.
"""
