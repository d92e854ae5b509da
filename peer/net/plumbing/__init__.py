"""peer.net.plumbing: hivemind underneath: the DHT and its bounded storage, the only module that touches hivemind's
private API, reachability and dial-back checks, a relay's limits.

Modules: ``hivemind_internals``, ``dht``, ``dht_storage``, ``reachability``, ``dial_back``, ``relay_check``.
"""
