"""Networking on hivemind, one folder per concern (docs/architecture.md, "Layout"):

- ``plumbing``: hivemind underneath (the DHT and its bounded storage, its private API in one module, reachability);
- ``flow``: what a remote peer can make us hold, the owner's bandwidth caps, deadlines that follow the links;
- ``trust``: signed, self-certifying progress records, authenticated runs, the offence ledger, average checks;
- ``view``: this peer's view of the swarm (whom we see and met, whom a round waits for, rounds in flight);
- ``policy``: pure decisions from the records (consensus, agreement), no I/O;
- ``round``: one round on the wire (matchmaking, the group's plan, the all-reduce, two levels, the runner);
- here: ``swarm`` (the owner of all of it: the networking thread, rounds), its ``heartbeat`` (our progress
  record out, everyone's in), ``our_record`` (what our record says, set by the training thread),
  ``state_transfer`` (snapshots and verified downloads), ``transport`` (the engine's transport over the swarm),
  ``probe`` (the doctor's look at a swarm).

May import: ``peer.outer``, ``peer.config``, ``peer.util``, ``peer.proto``; never ``peer.run``.
"""
