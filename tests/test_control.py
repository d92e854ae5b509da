"""The local control API (peer/control/): a real gRPC server on a unix socket in a run dir, a real client, the
token, bounds and limits; and the pure pieces (limits, the event feed). The swarm test is test_control_swarm.py."""

from __future__ import annotations

import datetime
import json
import os
import stat
import threading
from pathlib import Path

import grpc
import pytest

from peer.config import ConfigError, LimitsConfig
from peer.control.client import ControlClient, ControlError
from peer.control.controls import Controls, PeerState
from peer.control.feed import EventFeed
from peer.control.limits import Limits, in_window, vram_fraction
from peer.control.server import ENDPOINT_FILE, SOCKET_FILE, ControlServer, MAX_SOCKET_PATH
from peer.proto import control_pb2 as pb
from peer.proto import control_pb2_grpc as pb_grpc


def figures():
    return dict(peer_id="QmTest", step=42, loss=2.5, tokens_per_second=1000.0, live_peers=3, paused_peers=1,
                fragments=[dict(index=0, round=7, digest="ab" * 8, numel=100)], next_sync="in 3 steps",
                rounds_by_status={"ok": 6, "alone": 1}, tau=2, device="cpu", run_hash="0123abcd")


@pytest.fixture
def served(tmp_path):
    controls, feed = Controls(Limits()), EventFeed()
    server = ControlServer(tmp_path, controls, figures, feed)
    server.start()
    yield tmp_path, controls, feed, server
    server.stop()


def test_status_pause_resume_finish_and_limits_round_trip(served):
    run_dir, controls, _, _ = served
    with ControlClient(run_dir) as client:
        s = client.status()
        assert (s.peer_id, s.step, s.live_peers, s.paused_peers, s.state) == ("QmTest", 42, 3, 1, pb.STARTING)
        assert s.fragments[0].round == 7 and dict(s.rounds_by_status) == {"ok": 6, "alone": 1}
        assert s.limits.duty_cycle == 100
        assert "pausing" in client.pause().message and controls.pause_reason() == "paused by the owner"
        assert client.pause().message == "already paused"
        assert "resuming" in client.resume().message and controls.pause_reason() is None
        reply = client.set_limits(duty_cycle=40, active_hours="18:00-08:00")
        assert (reply.limits.duty_cycle, reply.limits.threads, reply.limits.active_hours) == (40, 0, "18:00-08:00")
        assert controls.limits.get() == Limits(duty_cycle=40, active_hours="18:00-08:00")
        with pytest.raises(ControlError, match="duty cycle must be a percent"):
            client.set_limits(duty_cycle=0)
        assert controls.limits.get().duty_cycle == 40  # a refused change changes nothing
        assert "finishing" in client.finish().message and controls.finish_requested
        controls.enter(PeerState.FINISHING, "completing the rounds in flight")
        assert client.status().state == pb.FINISHING


def test_endpoint_is_private_and_every_call_needs_the_token(served):
    run_dir, _, _, server = served
    for name in (ENDPOINT_FILE, SOCKET_FILE):
        assert stat.S_IMODE(os.stat(run_dir / name).st_mode) == 0o600, name
    endpoint = json.loads((run_dir / ENDPOINT_FILE).read_text())
    assert endpoint["address"] == f"unix:{run_dir.resolve() / SOCKET_FILE}" and endpoint["pid"] == os.getpid()
    with grpc.insecure_channel(endpoint["address"]) as channel:
        stub = pb_grpc.PeerControlStub(channel)
        for metadata in ((), (("authorization", "0" * 32),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Pause(pb.PauseRequest(), timeout=5, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            next(iter(stub.WatchEvents(pb.WatchRequest(), timeout=5)))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    server.stop()
    assert not (run_dir / ENDPOINT_FILE).exists() and not (run_dir / SOCKET_FILE).exists()


def test_a_long_run_dir_is_served_on_loopback_with_the_token(tmp_path):
    run_dir = tmp_path / ("d" * (MAX_SOCKET_PATH + 1))
    run_dir.mkdir()
    server = ControlServer(run_dir, Controls(Limits()), figures, EventFeed())
    try:
        assert server.start().startswith("127.0.0.1:")
        with ControlClient(run_dir) as client:
            assert client.status().step == 42
    finally:
        server.stop()


def test_watch_events_streams_new_events_and_bounds_the_watchers(served):
    run_dir, _, feed, _ = served
    feed.publish(json.dumps({"event": "old", "n": 0}))
    with ControlClient(run_dir) as client:
        got = []
        first = threading.Event()

        def follow():
            for event in client.watch(backlog=1):
                got.append(event)
                first.set()
                if len(got) == 2:
                    return

        t = threading.Thread(target=follow)
        t.start()
        assert first.wait(10), "the backlog event never arrived"
        feed.publish(json.dumps({"event": "round", "n": 1}))
        t.join(10)
        assert not t.is_alive()
        assert [e["event"] for e in got] == ["old", "round"]


def test_no_peer_running_is_one_line(tmp_path):
    with pytest.raises(ControlError, match="no peer is running in"):
        ControlClient(tmp_path)
    # a peer killed with -9 leaves its endpoint file: the dead pid is named
    dead = {"address": "unix:/nonexistent", "token": "x", "pid": 2 ** 22 + 7}
    (tmp_path / ENDPOINT_FILE).write_text(json.dumps(dead))
    with pytest.raises(ControlError, match="is gone"):
        ControlClient(tmp_path)


def test_cli_reports_a_missing_peer_and_bad_limits_in_one_line(tmp_path, capsys):
    from peer.cli.swarm_peer import main

    assert main(["status", "--run-dir", str(tmp_path)]) == 2
    assert "no peer is running in" in capsys.readouterr().err
    assert main(["limits", "--run-dir", str(tmp_path), "--active-hours", "25:00-01:00"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "HH:MM-HH:MM" in err


def test_cli_status_and_limits_against_a_served_peer(served, capsys):
    from peer.cli.swarm_peer import main

    run_dir = served[0]
    assert main(["status", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step 42" in out and "3 live, 1 paused" in out and "fragment 0: round 7" in out
    assert main(["limits", "--run-dir", str(run_dir), "--threads", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["limits"]["threads"] == 2
    assert main(["status", "--run-dir", str(run_dir), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["step"], got["state"], got["rounds_by_status"], got["fragments"][0]["round"]) == \
        (42, "STARTING", {"ok": 6, "alone": 1}, 7)


# ---- the pure pieces -----------------------------------------------------------------------------------------
def test_limits_duty_cycle_and_active_hours():
    assert Limits(duty_cycle=25).rest_after(1.0) == pytest.approx(3.0)  # trains 1 s of every 4
    assert Limits().rest_after(1.0) == 0.0
    night = Limits(active_hours="22:30-06:00")
    assert night.active(datetime.datetime(2026, 1, 1, 23, 0)) and night.active(datetime.datetime(2026, 1, 1, 5, 59))
    assert not night.active(datetime.datetime(2026, 1, 1, 6, 0)) and not night.active(datetime.datetime(2026, 1, 1, 12))
    assert in_window((9 * 60, 17 * 60), datetime.datetime(2026, 1, 1, 9, 0))
    for bad in (dict(duty_cycle=0), dict(duty_cycle=101), dict(threads=-1), dict(active_hours="9-17"),
                dict(active_hours="10:00-10:00")):
        with pytest.raises(ValueError):
            Limits(**bad)
    with pytest.raises(ConfigError, match="limits.active_hours"):
        LimitsConfig(active_hours="24:00-01:00")


def test_controls_outside_active_hours_pause_until_the_window():
    controls = Controls(Limits(active_hours="09:00-17:00"))
    assert controls.pause_reason(datetime.datetime(2026, 1, 1, 20)) == "outside the active hours 09:00-17:00"
    assert controls.pause_reason(datetime.datetime(2026, 1, 1, 10)) is None
    controls.pause()
    assert controls.pause_reason(datetime.datetime(2026, 1, 1, 10)) == "paused by the owner"


def test_event_feed_follower_that_falls_behind_skips_and_a_closed_feed_ends_it():
    feed = EventFeed(ring=4)
    for i in range(10):
        feed.publish(str(i))
    follower = feed.follow(backlog=100)
    assert [next(follower) for _ in range(4)] == ["6", "7", "8", "9"]  # the ring holds the last 4
    feed.close()
    assert list(follower) == []


def test_docker_health_check_asks_the_control_api(tmp_path):
    """The image's HEALTHCHECK (docker/swarm_docker.py): healthy while the peer answers and steps; a training peer
    idle for longer than the max age is unhealthy; a paused one is healthy; a gone one is unhealthy."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("swarm_docker", Path(__file__).parents[1] / "docker/swarm_docker.py")
    glue = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(glue)
    idle = {"s": 5.0}
    controls = Controls(Limits())
    server = ControlServer(tmp_path, controls, lambda: dict(figures(), idle_seconds=idle["s"]), EventFeed())
    server.start()
    try:
        controls.enter(PeerState.TRAINING)
        assert glue.check_run_dir(tmp_path, None, max_age=60) == (True, "training, step 42, 3 live peer(s)")
        idle["s"] = 600.0
        ok, why = glue.check_run_dir(tmp_path, None, max_age=60)
        assert not ok and "no step for 600s" in why
        controls.enter(PeerState.PAUSED, "paused by the owner")
        assert glue.check_run_dir(tmp_path, None, max_age=60)[0]
    finally:
        server.stop()
    (tmp_path / ENDPOINT_FILE).write_text(json.dumps({"address": "unix:/nonexistent", "token": "x", "pid": 1}))
    ok, why = glue.check_run_dir(tmp_path, None, max_age=60)
    assert not ok and "does not answer" in why


def test_metrics_endpoint_serves_the_status_figures():
    import urllib.request

    from peer.control.metrics import MetricsEndpoint

    controls = Controls(Limits(duty_cycle=50))
    controls.enter(PeerState.TRAINING)
    endpoint = MetricsEndpoint(lambda: dict(figures(), bytes_up=1000, bytes_down=2000), controls)
    port = endpoint.start("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        endpoint.stop()
    lines = set(text.splitlines())
    for line in ("swarmloco_step 42.0", "swarmloco_live_peers 3.0", "swarmloco_sent_bytes_total 1000.0",
                 'swarmloco_rounds_total{status="ok"} 6.0', 'swarmloco_fragment_round{fragment="0"} 7.0',
                 'swarmloco_state{state="training"} 1.0', 'swarmloco_state{state="paused"} 0.0',
                 "swarmloco_duty_cycle_ratio 0.5"):
        assert line in lines, (line, text)


def test_top_dashboard_shows_the_peer_and_its_keys_control_it(served, tmp_path_factory):
    """swarm-peer top, headless (textual's test pilot): the figures on screen, `p` pauses the peer, a screenshot."""
    import asyncio

    from textual.widgets import DataTable, Static

    from peer.cli.top import TopApp

    run_dir, controls, _, _ = served

    async def drive() -> str:
        with ControlClient(run_dir) as client:
            app = TopApp(client, refresh=0.2)
            async with app.run_test(size=(110, 32)) as pilot:
                await pilot.pause()
                state = str(app.query_one("#state", Static).render())
                figures_text = str(app.query_one("#figures", Static).render())
                assert "starting" in state and "step 42" in state, state
                assert "3 live, 1 paused" in figures_text and "ok 6" in figures_text, figures_text
                assert app.query_one("#fragments", DataTable).row_count == 1
                await pilot.press("p")
                await pilot.pause()
                assert controls.pause_reason() == "paused by the owner"
                shot = app.save_screenshot(path=str(tmp_path_factory.mktemp("top")))
            app.poll()  # a timer tick after shutdown (the screens are gone) must not raise
            return shot

    shot = asyncio.run(drive())
    assert Path(shot).read_text().startswith("<svg")


def test_the_duty_cycle_rests_after_a_step_and_a_request_ends_the_rest():
    """OwnerLink.rest: at 50% a step of 0.3 s is followed by 0.3 s of rest; at 1% a rest of 99 s ends as soon as
    the owner pauses (or a stop signal comes), not when it is over."""
    import time

    from peer.config import PeerConfig
    from peer.run.owner import OwnerLink

    stop = threading.Event()
    link = OwnerLink(PeerConfig(), stop)
    link.controls.set_limits(duty_cycle=50)
    shown: list[str] = []
    t0 = time.monotonic()
    link.rest(0.3, shown.append)
    assert time.monotonic() - t0 >= 0.3 and shown and shown[0] == "resting: duty cycle 50%"
    link.controls.set_limits(duty_cycle=1)
    link.controls.wake.clear()
    resting = threading.Thread(target=link.rest, args=(1.0, lambda s: None))
    resting.start()
    link.controls.pause()
    resting.join(10)
    assert not resting.is_alive(), "a pause request did not end the rest"


def test_the_vram_cap_is_a_share_of_the_device_and_binds_only_below_it():
    assert vram_fraction(6 * 2 ** 30, 24 * 2 ** 30) == 0.25
    assert vram_fraction(0, 24 * 2 ** 30) is None and vram_fraction(32 * 2 ** 30, 24 * 2 ** 30) is None
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="limits.vram_gb"):
            LimitsConfig(vram_gb=bad)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_a_cuda_vram_cap_refuses_an_allocation_above_it():
    """What ``limits.vram_gb`` sets at start (peer.run.local_build.cap_vram): the caching allocator refuses past
    the share."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(vram_fraction(2 ** 30, total), 0)
    try:
        small = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 256 MiB: inside the 1 GiB cap
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # 2 GiB: past it
        del small
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
