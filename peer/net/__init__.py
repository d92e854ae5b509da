"""Networking on hivemind: ``dht`` (creating the DHT; ``reachability`` explains unreachable peers), ``records``
and ``progress`` (signed progress records, who is live), ``consensus`` (what the records say a peer should do:
pure policy, no I/O), ``matchmaking`` (a group per round), ``allreduce`` (our butterfly all-reduce),
``state_transfer`` (snapshots and verified downloads), ``swarm`` (the owner of all of it: the networking
thread, heartbeat, rounds) and ``transport`` (the engine's transport over the swarm).
May import: ``peer.outer``, ``peer.config``, ``peer.util``, ``peer.proto``; never ``peer.run``.
"""
