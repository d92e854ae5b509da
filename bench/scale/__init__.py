"""A discrete-event simulation of the swarm's rounds at scale (issue 16, "Scale beyond this machine").

Modules: ``events`` (the heapq event core), ``links`` (home-broadband and fixed link draws), ``flows`` (the
flow-level network: each peer's uplink and downlink shared by its concurrent streams), ``calibration`` (the
costs taken from docs/benchmarks.md, each with its source), ``population`` (failures, restarts, state
downloads, who counts as live), ``flat`` (today's protocol: one butterfly group per round), ``bounded`` (the
proposed multi-level butterfly with a group cap), ``datapath`` (that design's data path on small tensors,
through the real codecs), ``runner`` (rounds, metrics) and ``report`` (tables, plots). The CLI is
``bench/scale_sim.py``; the results and what is not modelled are in docs/benchmarks.md.
"""
