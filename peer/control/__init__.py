"""The owner's controls of a running peer: ``controls`` (pause, resume, finish requests and the peer's state),
``limits`` (duty cycle, threads, active hours), ``feed`` (events for followers), ``server`` and ``client`` (the
local gRPC control API, ``protos/control.proto``). Imports: ``peer.config``, ``peer.util``, ``peer.proto``.
"""
