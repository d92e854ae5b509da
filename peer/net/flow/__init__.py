"""peer.net.flow: flow control: what a remote peer can make us hold (streams, frames), the owner's bandwidth caps and
their credit, deadlines that follow the measured links.

Modules: ``streams``, ``bandwidth``, ``credit``, ``links``.
"""
