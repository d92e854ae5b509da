"""Peers' links: uplink and downlink rates and latencies, drawn per peer from a seeded generator.

``home``: a home-broadband mix by access technology. The shares and medians are this simulation's assumptions,
informed by the FCC's Measuring Broadband America fixed reports (fiber, cable and DSL tiers; cable and DSL
uploads a tenth of their downloads or less; terrestrial latencies of 10-40 ms) and Ookla's fixed-broadband
medians (~100-250 Mbit/s down in rich countries by 2024); they are stated, not measured here:

| technology | share | down median (Mbit/s) | up median (Mbit/s) | last-mile one-way latency median |
|---|---|---|---|---|
| fiber | 35% | 300 | 200 | 4 ms |
| cable | 45% | 200 | 15 | 8 ms |
| DSL / fixed wireless | 20% | 25 | 3 | 15 ms |

Each rate is lognormal around its median (sigma 0.5 on ln), clipped to [0.5, 1000] Mbit/s; latencies lognormal
(sigma 0.4). Between two peers the one-way delay is both last miles plus a core path of 5 ms + 70 ms times
their distance on a unit circle of positions (at most 40 ms: a continent to intercontinental mix).

``fixed``: every peer at the same rate both ways (e.g. 100 Mbit/s), with the same latency model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MBIT = 1e6 / 8  # bytes per second in one Mbit/s

TECHNOLOGIES = (  # name, share, down median, up median (Mbit/s), last-mile one-way latency median (s)
    ("fiber", 0.35, 300.0, 200.0, 0.004),
    ("cable", 0.45, 200.0, 15.0, 0.008),
    ("dsl", 0.20, 25.0, 3.0, 0.015),
)
RATE_SIGMA, LATENCY_SIGMA = 0.5, 0.4
CORE_BASE_S, CORE_SPAN_S = 0.005, 0.070


@dataclass(kw_only=True)
class Links:
    """Per-peer link figures: rates in bytes/s, last-mile one-way latency (s), and a position for the core path."""

    up: np.ndarray
    down: np.ndarray
    last_mile: np.ndarray
    position: np.ndarray
    technology: np.ndarray  # index into TECHNOLOGIES (all -1 for fixed links)

    def __len__(self) -> int:
        return len(self.up)

    def one_way(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """One-way delay (s) between peers ``src[i]`` and ``dst[i]``."""
        d = np.abs(self.position[src] - self.position[dst])
        d = np.minimum(d, 1.0 - d)
        return self.last_mile[src] + self.last_mile[dst] + CORE_BASE_S + CORE_SPAN_S * 2 * d

    def rtt(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        return 2 * self.one_way(src, dst)


def home_broadband(n: int, rng: np.random.Generator) -> Links:
    """``n`` peers drawn from the home-broadband mix above."""
    shares = np.array([t[1] for t in TECHNOLOGIES])
    tech = rng.choice(len(TECHNOLOGIES), size=n, p=shares / shares.sum())
    down_med = np.array([t[2] for t in TECHNOLOGIES])[tech]
    up_med = np.array([t[3] for t in TECHNOLOGIES])[tech]
    lat_med = np.array([t[4] for t in TECHNOLOGIES])[tech]
    down = np.clip(down_med * np.exp(rng.normal(0, RATE_SIGMA, n)), 0.5, 1000.0) * MBIT
    up = np.clip(up_med * np.exp(rng.normal(0, RATE_SIGMA, n)), 0.5, 1000.0) * MBIT
    last_mile = lat_med * np.exp(rng.normal(0, LATENCY_SIGMA, n))
    return Links(up=up, down=down, last_mile=last_mile, position=rng.random(n), technology=tech)


def fixed(n: int, rng: np.random.Generator, mbit: float) -> Links:
    """``n`` peers at ``mbit`` Mbit/s both ways; latencies drawn as for home links (cable's last mile)."""
    last_mile = TECHNOLOGIES[1][4] * np.exp(rng.normal(0, LATENCY_SIGMA, n))
    rate = np.full(n, mbit * MBIT)
    return Links(up=rate, down=rate.copy(), last_mile=last_mile, position=rng.random(n),
                 technology=np.full(n, -1))


def draw(kind: str, n: int, rng: np.random.Generator) -> Links:
    """``kind``: ``home`` or ``fixed:<Mbit/s>`` (e.g. ``fixed:100``)."""
    if kind == "home":
        return home_broadband(n, rng)
    if kind.startswith("fixed:"):
        return fixed(n, rng, float(kind.split(":", 1)[1]))
    raise ValueError(f"unknown link kind {kind!r} (home or fixed:<Mbit/s>)")
