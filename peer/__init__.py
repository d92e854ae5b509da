"""swarmloco peer daemon: trains a shared model with (Streaming) DiLoCo in a hivemind DHT swarm.

The folders are the layers; each may import only those listed, plus the shared ``config/``, ``util``, ``errors``
and ``proto/`` (``tests/test_layers.py`` checks it; each folder's modules: docs/architecture.md, "Layout").

- ``local/``   local training: the model, this peer's data, the inner AdamW loop.
- ``outer/``   the outer algorithm, pure torch (no sockets, no DHT): fragments, schedules, outer state, the
               Streaming DiLoCo engine, the wire codecs, the in-process simulator.
- ``net/``     networking on hivemind: the DHT, progress records, consensus (pure), matchmaking, our all-reduce,
               state transfer, the swarm that owns them, the engine's transport.  Imports: outer.
- ``control/`` the owner's controls: the local control API and the pure pieces it shares with the loop.
- ``run/``     one peer's run: the trainer (the one place that composes).  Imports: local, outer, net, control.
- ``monitor/`` the operator's view of a run's swarm (a DHT client).  Imports: net.
- ``cli/``     ``swarm-peer`` and ``make demo``.  Imports: run, control, monitor (``prepare_data`` also local).
"""
