"""Generated protobuf modules (from ``protos/``; regenerate with ``make protos``).

Import them as ``from peer.proto import allreduce_pb2, codec_pb2, state_pb2``.
"""
