"""peer.net.policy: pure policy, no I/O: what the records say a peer should do (consensus) and when a group's round may
apply (agreement).

Modules: ``consensus``, ``agreement``.
"""
