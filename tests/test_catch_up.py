"""The drift repair's glue (peer/run/catch_up.py), with the swarm and the engine replaced by recorders: a repair
whose holders' records still show a round before ours waits, asks to be checked again, says so once, and
downloads our round once the records show it."""

from __future__ import annotations

import logging
import threading

import torch

from peer.net.trust.records import ProgressRecord
from peer.net.state_transfer import ServedState
from peer.outer.state import FragmentState
from peer.run.catch_up import StateSync
from peer.run.events import EventLog
from peer.run.pace import PaceWatch


def record(pid: str, round_: int, digest: str, past=()) -> ProgressRecord:
    return ProgressRecord(peer_id=pid, step=0, round=round_, tokens_per_second=0.0, client_mode=False, time=0.0,
                          rounds=[round_], digests=[digest], past=list(past))


class Swarm:
    """What StateSync asks of peer.net.swarm.Swarm, answered from ``records``; downloads are recorded."""

    peer_id = "me"

    def __init__(self, records: dict, past: dict):
        self.records, self.past, self.downloads = records, past, []

    def vouched_peers(self):
        return dict(self.records)

    live_peers = vouched_peers

    def partner_votes(self, records):  # (every applier is a partner of its own host here)
        return dict(records)

    @property
    def ours(self):  # (what our record says: Swarm.ours, answered here too)
        return self

    def recent_digests(self, num_fragments: int):
        return [dict(self.past)]

    def publish_snapshot(self, snap, adopted=False):
        pass

    def download_state(self, fragment, donors, *, round_, numel, digest, stop=None):
        self.downloads.append((fragment, round_, digest, sorted(donors)))
        return ServedState(fragment, round_, 100, torch.ones(numel), torch.zeros(numel), digest)


class Engine:
    """A one-fragment engine whose state applied round 12; ``in_flight``: the round it has in flight, if any."""

    schedule = None  # (not the steps schedule: the step is not moved)

    def __init__(self, in_flight: int = 0):
        state = FragmentState.from_params(torch.zeros(4))
        state.applied_rounds = [12]
        self.states, self.in_flight, self.adopted = [state], in_flight, []
        self.fragments = [type("Frag", (), {"index": 0, "numel": 4})()]

    def expected_round(self, p: int) -> int:
        return max(self.states[p].last_applied, self.in_flight)

    def adopt(self, p, G, v, round_, blocks=None):
        self.adopted.append((p, round_))
        self.states[p].applied_rounds = [round_]


def sync_for(swarm: Swarm, engine: Engine) -> StateSync:
    return StateSync(swarm, engine, events=EventLog(None), pace=PaceWatch("steps"), stop=threading.Event(),
                     sync_every=20, on_fragment=lambda *a: None, show_status=lambda s: None)


def test_a_repair_waits_for_the_holders_records_to_reach_our_round(caplog):
    # our round 11 went off (bad11); the holders' records still show round 11 while we applied 12
    swarm, engine = Swarm({p: record(p, 11, "good11") for p in ("x", "y")}, {11: "bad11"}), Engine()
    sync = sync_for(swarm, engine)
    with caplog.at_level(logging.INFO, logger="peer.run.catch_up"):
        for _ in range(3):
            assert sync.catch_up(50, joining=False) == 50
            assert sync.recheck and not swarm.downloads and not engine.adopted
    said = [r.message for r in caplog.records if "records still show round 11, before ours (12)" in r.message]
    assert len(said) == 1, caplog.text  # once per round we wait at

    # a heartbeat later the records show where the holders are: our round 12, which is downloaded and adopted
    swarm.records = {p: record(p, 12, "good12", past=[(0, 11, "good11")]) for p in ("x", "y")}
    sync.catch_up(51, joining=False)
    assert swarm.downloads == [(0, 12, "good12", ["x", "y"])] and engine.adopted == [(0, 12)]
    assert not sync.recheck


def test_a_repair_waits_while_our_next_round_is_in_flight():
    """Adopting round 12 would cancel our round 13 in flight while the swarm applies it: a round behind again."""
    moved = {p: record(p, 12, "good12", past=[(0, 11, "good11")]) for p in ("x", "y")}
    swarm, engine = Swarm(moved, {11: "bad11"}), Engine(in_flight=13)
    sync = sync_for(swarm, engine)
    sync.catch_up(60, joining=False)
    assert sync.recheck and not swarm.downloads
    engine.in_flight = 0  # (it ended without applying anything: our state is still at 12, the holders' round)
    sync.catch_up(61, joining=False)
    assert swarm.downloads == [(0, 12, "good12", ["x", "y"])] and not sync.recheck


def test_when_the_loop_catches_up_is_the_state_syncs_decision_and_adoption_is_told():
    """StateSync.due: at once after a late round (note_late), a recheck_after later while a repair waits for
    records, every drift_check_period otherwise; a catch-up resets it. ``adopted`` says whether the last one
    took a snapshot (the trainer then meets the swarm's phase)."""
    swarm, engine = Swarm({p: record(p, 11, "good11") for p in ("x", "y")}, {11: "bad11"}), Engine()
    sync = StateSync(swarm, engine, events=EventLog(None), pace=PaceWatch("steps"), stop=threading.Event(),
                     sync_every=20, on_fragment=lambda *a: None, show_status=lambda s: None,
                     drift_check_period=3600.0, recheck_after=3600.0)
    assert not sync.due()
    sync.note_late()
    assert sync.due()
    sync.catch_up(50, joining=False)  # (the repair waits for the holders' records: recheck, not yet due)
    assert not sync.late and sync.recheck and not sync.due() and not sync.adopted
    sync.recheck_after = 0.0
    assert sync.due()
    swarm.records = {p: record(p, 12, "good12", past=[(0, 11, "good11")]) for p in ("x", "y")}
    sync.catch_up(51, joining=False)
    assert sync.adopted and not sync.recheck
    sync.drift_check_period = 1e-9
    assert sync.due()  # the periodic drift check


def test_the_drift_check_keeps_the_state_our_group_applied_against_records_of_others():
    """Sybils that sat in one of our groups (partners, so their records count) claim another digest at the round
    our group applied: the group's appliers hold ours by construction, so only their records can move us. After
    we adopt a state from donors, no group of ours applied it, and the records' majority rules again."""
    forged = {p: record(p, 12, "forged12") for p in ("s1", "s2", "s3")}
    honest = {"g1": record("g1", 12, "ours12")}
    swarm, engine = Swarm({**forged, **honest}, {}), Engine()
    sync = sync_for(swarm, engine)
    sync._digests[0] = "ours12"
    sync.note_applied(0, 12, ["me", "g1"])
    sync.note_applied(0, 11, ["x"])  # (not an applier ourselves: nothing to keep)
    assert sync._confirmed == {0: {12: frozenset({"g1"})}}
    sync.catch_up(50, joining=False)
    assert swarm.downloads == [] and engine.adopted == []
    swarm.records = dict(forged)  # (our co-applier left: still nothing outvotes the group)
    sync.catch_up(51, joining=False)
    assert swarm.downloads == []
    swarm.records = {**forged, "g1": record("g1", 12, "theirs12"), "g2": record("g2", 12, "theirs12")}
    sync.note_applied(0, 12, ["me", "g1", "g2"])
    sync.catch_up(52, joining=False)  # our co-appliers say our state is off: theirs is downloaded
    assert swarm.downloads == [(0, 12, "theirs12", ["g1", "g2"])] and 0 not in sync._confirmed


def test_a_joiner_acts_on_the_vouched_records_not_on_every_live_one():
    """A joiner (or a peer back from a pause) downloads the state the vouched records hold (Swarm.vouched_peers:
    partners, or the peers its daemon answers for, one per host), never that of live ids no daemon answers for,
    however many claim a later round."""
    sybils = {p: record(p, 40, "forged40") for p in ("s1", "s2", "s3")}
    honest = {p: record(p, 14, "good14") for p in ("x", "y")}
    swarm, engine = Swarm(honest, {}), Engine()
    swarm.live_peers = lambda: {**honest, **sybils}  # type: ignore[method-assign]
    sync = sync_for(swarm, engine)
    sync.catch_up(10, joining=True)
    assert swarm.downloads == [(0, 14, "good14", ["x", "y"])] and engine.adopted == [(0, 14)]


def test_an_owed_download_counts_the_appliers_records_through_the_partner_vote():
    """After an off-base round, the appliers' records say what to download; they are counted as
    Swarm.partner_votes counts them (one per host), so sybil appliers of one host are one voice."""
    swarm, engine = Swarm({**{p: record(p, 13, "forged13") for p in ("s1", "s2", "s3")},
                           **{p: record(p, 13, "good13") for p in ("x", "y")}}, {}), Engine()
    swarm.partner_votes = lambda records: {p: r for p, r in records.items() if p in ("s1", "x", "y")}  # type: ignore
    sync = sync_for(swarm, engine)
    sync.owe(0, 13, ["s1", "s2", "s3", "x", "y"])
    sync.catch_up(20, joining=False)
    assert swarm.downloads == [(0, 13, "good13", ["x", "y"])]
