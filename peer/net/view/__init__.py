"""peer.net.view: this peer's view of the swarm: whom we see and have met (roster), whom a round waits for
(attendance), what our rounds in flight are doing (activity).

Modules: ``roster``, ``attendance``, ``activity``.
"""
