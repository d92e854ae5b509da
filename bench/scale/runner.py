"""Runs round slots of one configuration (design, swarm size, failure rate, links) and sums them up."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bounded import bounded_round
from .calibration import Workload
from .flat import flat_round
from .links import MBIT, draw
from .matching import RoundOutcome
from .population import Population

DESIGNS = ("flat", "bounded")


@dataclass(kw_only=True, frozen=True)
class Config:
    design: str  # flat, flat-attendance (whom a round waits for), flat-ideal (no group-size or stream caps), bounded
    peers: int
    p_fail: float
    links: str = "fixed:100"
    rounds: int = 12
    seed: int = 0
    cap: int = 8
    cutoff: float = 5.0
    holder_min_mbit: float = 10.0  # bounded: peers with a slower uplink hold no slot (they are members only)


def run_round(cfg: Config, t0: float, pop: Population, wl: Workload, rng: np.random.Generator) -> RoundOutcome:
    training, live, death = pop.round_start(t0)
    if cfg.design == "bounded":
        members_only = pop.client | (pop.links.up < cfg.holder_min_mbit * MBIT)
        return bounded_round(t0, training, live, death, members_only, pop.links, wl, rng, cap=cfg.cap,
                             cutoff=cfg.cutoff)
    if cfg.design == "flat-attendance":  # whom the round waits for (peer/net/view/attendance.py)
        live = pop.expected
    return flat_round(t0, training, live, death, pop.client, pop.links, wl, rng, ideal=cfg.design == "flat-ideal",
                      waits_for_dead=cfg.design == "flat-waits")


def simulate(cfg: Config, wl: Workload) -> dict:
    """Runs ``cfg.rounds`` slots after a warm-up of failures and rejoins; returns the summary (plain numbers)."""
    rng = np.random.default_rng([cfg.seed, cfg.peers, int(cfg.p_fail * 1e4)])
    links = draw(cfg.links, cfg.peers, rng)
    pop = Population(links, wl, cfg.p_fail, rng)
    pop.warm_up(30 * wl.slot_s)
    rows = [run_round(cfg, r * wl.slot_s, pop, wl, rng) for r in range(cfg.rounds)]
    return summarize(cfg, wl, rows, pop)


def summarize(cfg: Config, wl: Workload, rows: list[RoundOutcome], pop: Population) -> dict:
    keep = [~o.died for o in rows]
    cat = lambda f: np.concatenate([f(o)[k] for o, k in zip(rows, keep)])  # noqa: E731
    took = cat(lambda o: o.end - o.launch)
    applied = cat(lambda o: o.applied)
    blocked = cat(lambda o: o.blocked(wl))
    grouped = cat(lambda o: o.in_group)
    mm = cat(lambda o: o.matchmaking_s)
    sizes = [o.extra.get("group_size", o.extra.get("max_group", 0)) for o in rows]
    statuses = [o.status for o in rows]
    return {
        "design": cfg.design, "peers": cfg.peers, "p_fail": cfg.p_fail, "links": cfg.links, "rounds": cfg.rounds,
        "round_s_median": float(np.median(took)), "round_s_p90": float(np.percentile(took, 90)),
        "applied": float(applied.mean()), "all_spans": float(np.mean(applied >= 1 - 1e-9)),
        "in_group": float(grouped.mean()),
        "sent_mb": float(cat(lambda o: o.sent)[grouped].mean() / 1e6) if grouped.any() else 0.0,
        "received_mb": float(cat(lambda o: o.received)[grouped].mean() / 1e6) if grouped.any() else 0.0,
        "utilization": float(wl.slot_s / (wl.slot_s + blocked.mean())),
        "streams_max": float(max(o.streams.max() for o in rows)),
        "partners_max": float(max(o.remote_peers.max() for o in rows)),
        "partners_per_level": float(max(o.extra.get("per_level_partners", o.remote_peers.max()) for o in rows)),
        "matchmaking_s": float(np.nanmedian(mm)) if np.isfinite(mm).any() else float("nan"),
        "matchmaking_p90": float(np.nanpercentile(mm, 90)) if np.isfinite(mm).any() else float("nan"),
        "group": float(np.max(sizes)), "levels": int(max(o.levels for o in rows)),
        "exposure": float((1 - cfg.p_fail) ** max(sizes)) if cfg.design != "bounded" else float("nan"),
        "status": {s: statuses.count(s) for s in sorted(set(statuses))},
        "failures": pop.failures, "training": float(np.mean([o.peers.size for o in rows]) / cfg.peers),
        "flow_steps": int(sum(o.flow_steps for o in rows)),
    }
