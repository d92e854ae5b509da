"""swarmloco peer daemon: trains a shared model with (Streaming) DiLoCo in a hivemind DHT swarm.

The folders are the layers; each may import only the ones listed (``tests/test_layers.py`` checks it):

- ``local/``  local training: the model, this peer's data, the inner AdamW loop.  Imports: config, util.
- ``outer/``  the outer algorithm, pure torch (no sockets, no DHT): fragments, schedules, outer state and
              optimizer, round outcomes, the Streaming DiLoCo engine, the wire codec, the in-process
              simulator.  Imports: config, util, proto.
- ``net/``    networking on hivemind: the DHT, progress records, the consensus policy read from them (pure),
              matchmaking, our all-reduce, state transfer, the swarm that owns them, the engine's transport.
              Imports: outer, config, util, proto.
- ``control/`` the owner's controls: the local control API (gRPC: status, pause, resume, finish, limits, events)
              and the pure pieces it shares with the loop (requests, limits, the event feed).  Imports: config,
              util, proto.
- ``run/``    one peer's run, the composition: the trainer (the one place that composes), checkpoints,
              events, the status line, the run dir lock, checks before joining, the owner's link.  Imports:
              everything below.
- ``monitor/`` the operator's view of a run's swarm: what the progress records say (pure), served as a web page
              and a JSON API by a DHT client.  Imports: net, config, util.
- ``cli/``    the command line: ``swarm-peer`` and ``make demo``.  Imports: config, run, control, monitor.
- ``config.py`` typed settings (TOML + ``SWARM_*`` env + flags; the run hash), ``util.py`` small helpers:
  every layer may import them. ``proto/``: generated protobuf modules (``make protos``).
"""
