"""The flow-level network: streams between peers as fluid flows, each peer's uplink and downlink shared by the
streams it has open at the time.

A flow from ``s`` to ``d`` moves at ``efficiency * min(up[s] / streams out of s, down[d] / streams into d)``: the
per-link fair share TCP gives concurrent streams, taken at the tighter end. It is not work-conserving (a share a
stream cannot use at its other end is not handed to the others), so it errs slow, and no link ever carries more
than its rate. ``efficiency`` is the share of the nominal rate payload gets (calibration.py).

A flow starts one round trip after it is allowed to (the stream's open), and completes one one-way delay after its
last byte leaves. A flow can wait on a *gate* (a reducer's average waits for its parts): the gate opens when every
flow feeding it completed (not before ``not_before``), or at its ``deadline`` once any feeding flow was cut or the
deadline passed, and its flows start ``delay`` seconds after it opens (the reducer's combine and encode). A flow is
cut at its deadline or when either end dies; the bytes it moved until then still count.

Time advances in steps: to the next completion, start, cut or gate deadline, but at least ``quantum`` (and at least
``quantum_rel`` of the time elapsed), so a million flows take a few hundred steps. Flows that finish inside a step
finish at their exact time; the capacity they free is shared again at the next step (the error: slow, bounded by
the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

PENDING, ACTIVE, DONE, CUT = 0, 1, 2, 3


@dataclass
class FlowSet:
    """Flows and gates of one round, built by a protocol model (``add``, ``gate``), solved by :func:`solve`."""

    _cols: dict[str, list[np.ndarray]] = field(default_factory=lambda: {k: [] for k in
                                               ("src", "dst", "size", "start", "wait", "feed", "deadline")})
    gate_deadline: list[float] = field(default_factory=list)
    gate_not_before: list[float] = field(default_factory=list)
    gate_delay: list[float] = field(default_factory=list)
    gate_on_end: list[bool] = field(default_factory=list)
    count: int = 0

    def gate(self, deadline: float, not_before: float = 0.0, delay: float = 0.0, on_end: bool = False) -> int:
        """A gate; ``on_end``: it opens once every feeding flow completed *or was cut* (its owner learns of a
        reset at once and goes on with what arrived), instead of waiting for its deadline after a cut."""
        self.gate_on_end.append(on_end)
        self.gate_deadline.append(deadline)
        self.gate_not_before.append(not_before)
        self.gate_delay.append(delay)
        return len(self.gate_deadline) - 1

    def add(self, src, dst, size, *, start=np.inf, wait=-1, feed=-1, deadline=np.inf) -> np.ndarray:
        """Adds flows (scalars or arrays, broadcast); ``start`` inf with ``wait`` >= 0 for gated flows. Returns
        their indices."""
        src, dst, size, start, wait, feed, deadline = np.broadcast_arrays(
            np.asarray(src, np.int64), np.asarray(dst, np.int64), np.asarray(size, float), np.asarray(start, float),
            np.asarray(wait, np.int64), np.asarray(feed, np.int64), np.asarray(deadline, float))
        for key, col in zip(("src", "dst", "size", "start", "wait", "feed", "deadline"),
                            (src, dst, size, start, wait, feed, deadline)):
            self._cols[key].append(np.ravel(col).copy())
        first = self.count
        self.count += src.size
        return np.arange(first, self.count)

    def column(self, key: str) -> np.ndarray:
        parts = self._cols[key]
        dtype = np.int64 if key in ("src", "dst", "wait", "feed") else float
        return np.concatenate(parts) if parts else np.zeros(0, dtype)


@dataclass
class FlowResult:
    finish: np.ndarray  # completion time, or when the flow was cut (state says which)
    moved: np.ndarray  # bytes moved (== size where completed)
    state: np.ndarray  # DONE or CUT
    gate_open: np.ndarray  # when each gate opened
    steps: int

    @property
    def completed(self) -> np.ndarray:
        return self.state == DONE


def solve(flows: FlowSet, up: np.ndarray, down: np.ndarray, death: np.ndarray,
          one_way: Callable[[np.ndarray, np.ndarray], np.ndarray], *, efficiency: float = 1.0,
          quantum: float = 0.01, quantum_rel: float = 0.03, max_steps: int = 200_000) -> FlowResult:
    """Runs every flow to completion or cut. ``up``/``down`` in bytes/s per peer, ``death`` per peer (inf: lives)."""
    src, dst, size = flows.column("src"), flows.column("dst"), flows.column("size")
    wait, feed = flows.column("wait"), flows.column("feed")
    n_gates = len(flows.gate_deadline)
    g_deadline = np.asarray(flows.gate_deadline, float)
    g_not_before = np.asarray(flows.gate_not_before, float)
    g_delay = np.asarray(flows.gate_delay, float)
    g_on_end = np.asarray(flows.gate_on_end, bool)
    local = src == dst  # a zero-byte step inside one peer (chains one gate to another): no link, no delay
    ow = np.where(local, 0.0, one_way(src, dst)) if src.size else np.zeros(0)
    setup = 2 * ow  # the stream's open: one round trip
    start = np.where(wait >= 0, np.inf, flows.column("start") + setup)
    end_cut = np.minimum(flows.column("deadline"), np.minimum(death[src], death[dst])) if src.size else np.zeros(0)
    rem, moved = size.copy(), np.zeros_like(size)
    finish, state = np.full(size.shape, np.inf), np.full(size.shape, PENDING, np.int8)
    g_need = np.bincount(feed[feed >= 0], minlength=n_gates)
    g_done = np.zeros(n_gates, np.int64)
    g_ended = np.zeros(n_gates, np.int64)
    g_last = np.full(n_gates, -np.inf)
    g_cut = np.zeros(n_gates, bool)
    g_open = np.full(n_gates, np.inf)
    has_feed = feed >= 0
    t0 = float(np.min(start)) if np.isfinite(start).any() else 0.0
    t0 = min([t0] + [float(x) for x in g_not_before[g_need == 0]]) if n_gates else t0
    t, steps = t0, 0
    while steps < max_steps:
        steps += 1
        # gates that can be decided now
        closed = np.isinf(g_open)
        if closed.any():
            ready = closed & ((g_done == g_need) | (g_on_end & (g_ended == g_need)))
            g_open[ready] = np.maximum(g_last[ready], g_not_before[ready])
            late = closed & ~ready & ((g_cut & ~g_on_end) | (g_deadline <= t))
            g_open[late] = g_deadline[late]
            newly = ready | late
            if newly.any():
                gated = (state == PENDING) & (wait >= 0) & np.isinf(start)
                idx = np.flatnonzero(gated & newly[np.maximum(wait, 0)])
                start[idx] = g_open[wait[idx]] + g_delay[wait[idx]] + setup[idx]
        pending = state == PENDING
        doomed = pending & (end_cut <= np.minimum(start, t))  # dead end or deadline before it could start
        if doomed.any():
            finish[doomed] = end_cut[doomed]
            _mark_cut(doomed, state, feed, has_feed, g_cut, g_ended, g_last, finish)
            pending &= ~doomed
        state[pending & (start <= t)] = ACTIVE
        act = np.flatnonzero(state == ACTIVE)
        nxt_start = float(np.min(start[pending & (start > t)], initial=np.inf))
        nxt_gate = float(np.min(g_deadline[np.isinf(g_open)], initial=np.inf)) if n_gates else np.inf
        if act.size == 0:
            nxt = min(nxt_start, nxt_gate, float(np.min(end_cut[state == PENDING], initial=np.inf)))
            if not np.isfinite(nxt):
                break
            t = max(t, nxt)
            continue
        s, d, remote = src[act], dst[act], ~local[act]
        n_out = np.bincount(s[remote], minlength=up.size)
        n_in = np.bincount(d[remote], minlength=down.size)
        rate = np.full(act.size, np.inf)
        rate[remote] = efficiency * np.minimum(up[s[remote]] / n_out[s[remote]], down[d[remote]] / n_in[d[remote]])
        ttf = np.where(rem[act] > 0, rem[act] / rate, 0.0)
        horizon = min(float(ttf.min()), float(end_cut[act].min()) - t, nxt_start - t, nxt_gate - t)
        dt = max(horizon, quantum, quantum_rel * (t - t0))
        usable = np.clip(np.minimum(end_cut[act], t + dt) - t, 0.0, None)
        fin = ttf <= usable
        fi = act[fin]
        finish[fi] = t + ttf[fin] + ow[fi]
        moved[fi] += rem[fi]
        rem[fi] = 0.0
        state[fi] = DONE
        fd = fi[has_feed[fi]]
        if fd.size:
            np.add.at(g_done, feed[fd], 1)
            np.add.at(g_ended, feed[fd], 1)
            np.maximum.at(g_last, feed[fd], finish[fd])
        go = act[~fin]
        step_bytes = np.minimum(rem[go], rate[~fin] * usable[~fin])
        moved[go] += step_bytes
        rem[go] -= step_bytes
        cut_now = np.zeros(state.shape, bool)
        cut_now[go[end_cut[go] <= t + dt]] = True
        if cut_now.any():
            finish[cut_now] = end_cut[cut_now]
            _mark_cut(cut_now, state, feed, has_feed, g_cut, g_ended, g_last, finish)
        t += dt
    return FlowResult(finish, moved, state, g_open, steps)


def _mark_cut(mask, state, feed, has_feed, g_cut, g_ended, g_last, finish) -> None:
    state[mask] = CUT
    cut = np.flatnonzero(mask & has_feed)
    g_cut[feed[cut]] = True
    np.add.at(g_ended, feed[cut], 1)
    np.maximum.at(g_last, feed[cut], finish[cut])
