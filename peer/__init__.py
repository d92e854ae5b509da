"""swarmloco peer daemon: trains a shared model with (Streaming) DiLoCo in a hivemind DHT swarm.

Map of the code (math is pure torch and tested alone; networking is a thin layer; ``train`` composes):

- ``config``      typed, validated config: TOML + ``SWARM_*`` env + flags; the run hash.
- ``cli``         ``swarm-peer run``; ``demo`` is ``make demo`` (bootstrap + 3 peers + summary).
- ``model``       Chinchilla-style decoder (RMSNorm, QK-norm, RoPE, z-loss), presets, plug-in factory.
- ``data``        token sources: seeded Markov corpus with a known entropy floor, text files, uint16 shards.
- ``inner``       the inner loop: AdamW, warmup + cosine LR, clipping, bf16 autocast on CUDA.
- ``fragments``   which parameters sync together (P fragments of k blocks, strided/sequential).
- ``schedule``    when fragment p syncs: steps schedule (paper) or clock schedule (volunteers).
- ``outer``       outer state per fragment (G, v, S, E, u), Nesterov outer step, span-wise apply.
- ``streaming``   the outer engine: launch, overlap tau (or auto), eager updates, alpha/replay merge.
- ``simulator``   M replicas of the engine in-process over a fake transport (tests, ablations).
- ``codec``       wire codecs (``encode``/``decode`` <-> ``EncodedTensor``), validation of peer data.
- ``progress``    signed, schema-checked progress records in the DHT (who is live, how far).
- ``matchmaking`` one group per (fragment, round), on hivemind's leader-based Matchmaking.
- ``allreduce``   our butterfly all-reduce protocol (protos/allreduce.proto) and its servicer.
- ``swarm``       owner of the DHT, the networking thread, heartbeat, servicers and rounds.
- ``state_transfer`` snapshots, the chunked verified state download, the catch-up / drift plan.
- ``checkpoint``  atomic, checksummed checkpoints of a peer; resume.
- ``dht_node``    DHT creation shared with the bootstrap node (identity, NAT mapping opt-in).
- ``events``      JSON-lines event log and the console status line.
- ``train``       the training loop: composes the above; checkpoints, catch-up, signals.
- ``proto``       generated protobuf modules (``make protos``; a test checks they are fresh).
"""
