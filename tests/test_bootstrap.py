"""The real ``swarm-bootstrap`` command, on loopback only (127.0.0.1, port 0)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import Proc, wait_for

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
PASTE_RE = r"^--initial-peers (/\S+(?: /\S+)*)$"
START_TIMEOUT = 60


def clean_env(**extra: str) -> dict:
    """No SWARM_* from the developer's shell may leak into the node under test (it could bind 0.0.0.0)."""
    return {**{k: None for k in os.environ if k.startswith("SWARM_")}, **extra}


def bootstrap_cmd(*flags: str) -> list[str]:
    script = Path(sys.executable).parent / "swarm-bootstrap"  # the console script from pyproject.toml
    base = [str(script)] if script.exists() else [sys.executable, "-m", "bootstrap"]
    return base + list(flags)


def start_bootstrap(procs, tmp_path: Path, name: str, *flags: str) -> tuple[Proc, list[str]]:
    proc = Proc.start(bootstrap_cmd(*flags), log_path=tmp_path / f"{name}.log", cwd=tmp_path, env=clean_env())
    procs.append(proc)
    maddrs = proc.wait_for_line(PASTE_RE, START_TIMEOUT).group(1).split()
    return proc, maddrs


def run_quick(args, tmp_path, env=None):
    env = {k: v for k, v in {**os.environ, **clean_env(**(env or {}))}.items() if v is not None}
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def stock_dht(initial_peers: list[str]):
    """A plain hivemind DHT, as any hivemind user would start one (loopback, no NAT port mapping)."""
    import hivemind

    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=[LOOPBACK], nat_port_map=False,
                       check_if_identity_free=False, start=False)
    try:
        dht.run_in_background(await_ready=True, timeout=START_TIMEOUT)
    except BaseException:
        dht.shutdown()
        raise
    return dht


def test_help_is_fast_and_lists_flags(tmp_path):
    started = time.monotonic()
    result = run_quick(bootstrap_cmd("--help"), tmp_path)
    assert result.returncode == 0, result.stderr
    for flag in ("--host-maddrs", "--announce-maddrs", "--identity-path", "--initial-peers", "--nat-port-map",
                 "--relay-service", "--refresh-period", "--log-level", "SWARM_"):
        assert flag in result.stdout
    assert time.monotonic() - started < 20
    assert not list(tmp_path.iterdir())  # --help creates no identity file


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (["--host-maddrs", "foo"], {}, r"--host-maddrs: 'foo' is not a multiaddr \(expected /ip4/HOST/tcp/PORT\)$"),
        (["--refresh-period", "soon"], {}, r"--refresh-period: 'soon' is not a number"),
        (["--refresh-period", "1201"], {}, r"--refresh-period: at most 1200 seconds \(DHT nodes keep no record"),
        ([], {"SWARM_NAT_PORT_MAP": "perhaps"}, r"SWARM_NAT_PORT_MAP \(--nat-port-map\): 'perhaps'"),
        (["--log-level", "LOUD"], {}, r"--log-level: 'LOUD' is not one of"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path, flags, env, message):
    result = run_quick(bootstrap_cmd("--identity-path", "x.id", *flags), tmp_path, env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("swarm-bootstrap: error: ")
    assert re.search(message, lines[0]), lines[0]
    assert result.stdout == ""
    assert not (tmp_path / "x.id").exists()


def test_parse_args_env_twins_and_paste_line_round_trip():
    from bootstrap.cli import UsageError, parse_args

    args = parse_args(["--identity-path", "a.id"], env={})
    assert args.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"] and args.initial_peers == []
    assert args.nat_port_map is False and args.refresh_period == 60 and args.log_level == "INFO"
    assert args.relay_service is False
    assert parse_args([], env={"SWARM_RELAY_SERVICE": "on", "SWARM_IDENTITY_PATH": "a.id"}).relay_service is True
    env = {"SWARM_HOST_MADDRS": "/ip4/127.0.0.1/tcp/1, /ip4/127.0.0.1/tcp/2", "SWARM_NAT_PORT_MAP": "yes",
           "SWARM_INITIAL_PEERS": "/a /b,/c", "SWARM_IDENTITY_PATH": "e.id", "SWARM_REFRESH_PERIOD": "2.5",
           "SWARM_LOG_LEVEL": "debug", "SWARM_ANNOUNCE_MADDRS": "/ip4/1.2.3.4/tcp/31337"}
    args = parse_args([], env=env)
    assert args.host_maddrs == ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"]
    assert args.initial_peers == ["/a", "/b", "/c"] and args.announce_maddrs == ["/ip4/1.2.3.4/tcp/31337"]
    assert (args.identity_path, args.nat_port_map, args.refresh_period, args.log_level) == ("e.id", True, 2.5, "DEBUG")
    # a flag on the command line wins over its environment twin (and replaces, not extends, a list)
    args = parse_args(["--host-maddrs", "/x", "--host-maddrs", "/y", "--no-nat-port-map"], env=env)
    assert args.host_maddrs == ["/x", "/y"] and args.nat_port_map is False
    # the printed line is exactly what the flags take back
    line = "--initial-peers /ip4/127.0.0.1/tcp/5/p2p/QmA /ip4/127.0.0.1/tcp/6/p2p/QmA"
    assert parse_args(line.split(), env={}).initial_peers == line.split()[1:]
    with pytest.raises(UsageError, match=r"^SWARM_REFRESH_PERIOD \(--refresh-period\): '0' must be a positive"):
        parse_args([], env={"SWARM_REFRESH_PERIOD": "0"})


def test_sigterm_during_startup_is_a_clean_exit(tmp_path, procs):
    proc = Proc.start(bootstrap_cmd("--host-maddrs", LOOPBACK, "--identity-path", "x.id"),
                      log_path=tmp_path / "early.log", cwd=tmp_path, env=clean_env())
    procs.append(proc)
    proc.wait_for_line(r"starting DHT node", START_TIMEOUT)  # signal handlers are installed by now
    assert proc.terminate(timeout=30) == 0, proc.tail()
    wait_for(lambda: not proc.session_pids(), 10, "everything in the bootstrap's session to exit")


def test_bootstrap_swarm_end_to_end(tmp_path, procs):
    from hivemind.utils import get_dht_time

    flags = ["--host-maddrs", LOOPBACK, "--identity-path", "tmp/x.id", "--refresh-period", "0.5"]
    first, maddrs = start_bootstrap(procs, tmp_path, "first", *flags)

    # the paste line: multiaddrs that all end in the same /p2p/ id, read from the identity file
    from hivemind.utils.multiaddr import Multiaddr
    from peer.net.plumbing.addresses import ensure_identity

    assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") for m in maddrs)
    peer_ids = {Multiaddr(m)["p2p"] for m in maddrs}
    identity = tmp_path / "tmp" / "x.id"
    assert identity.is_file() and oct(identity.stat().st_mode & 0o777) == "0o400"
    assert peer_ids == {ensure_identity(identity)}
    first.wait_for_line(r"peer id: " + next(iter(peer_ids)), 5)

    dhts = []
    try:
        # two stock hivemind DHTs join through the bootstrap node; one stores, the other reads
        dhts.append(stock_dht(maddrs))
        dhts.append(stock_dht(maddrs))
        key, value = "swarmloco-test-key", {"hello": "swarm"}
        stored = wait_for(lambda: dhts[0].store(key, value, get_dht_time() + 120), 20, "a successful DHT store")
        assert stored
        got = wait_for(lambda: dhts[1].get(key, latest=True), 20, "the stored value to be readable")
        assert got.value == value
        first.wait_for_line(r"DHT peers in routing table: [1-9]", 20)

        # a second bootstrap node joins the first; a DHT that knows only the second one finds the value
        second, second_maddrs = start_bootstrap(
            procs, tmp_path, "second", "--host-maddrs", LOOPBACK, "--identity-path", "y.id",
            "--refresh-period", "0.5", "--initial-peers", *maddrs)
        assert {Multiaddr(m)["p2p"] for m in second_maddrs}.isdisjoint(peer_ids)
        second.wait_for_line(r"DHT peers in routing table: [1-9]", 20)
        dhts.append(stock_dht(second_maddrs))
        got = wait_for(lambda: dhts[2].get(key, latest=True), 20, "the value through the second bootstrap")
        assert got.value == value
    finally:
        for dht in dhts:
            dht.shutdown()

    for proc in (second, first):
        assert proc.terminate(timeout=20) == 0, proc.tail()
        wait_for(lambda: not proc.session_pids(), 10, "the bootstrap's p2pd to exit")
        assert any("DHT node shut down" in line for line in proc.lines()), proc.tail()

    # restart with the same identity file: same peer id
    again, again_maddrs = start_bootstrap(procs, tmp_path, "again", *flags)
    assert {Multiaddr(m)["p2p"] for m in again_maddrs} == peer_ids
    again.popen.send_signal(signal.SIGINT)  # Ctrl-C is a clean stop too
    assert again.popen.wait(timeout=20) == 0, again.tail()
    wait_for(lambda: not again.session_pids(), 10, "the restarted bootstrap's p2pd to exit")


def test_the_relay_check_tells_the_configured_limits_from_libp2ps_defaults(tmp_path, procs):
    """A node started with --relay-service checks at start that a relayed stream carries 512 KiB, and says so; a
    node without it relays under libp2p's default limits (128 KiB per relayed connection), which the check
    finds (peer/net/plumbing/relay_check.py: two throwaway daemons on this host, the target listening nowhere)."""
    from peer.net.plumbing.relay_check import relay_serves

    service, maddrs = start_bootstrap(procs, tmp_path, "service", "--host-maddrs", LOOPBACK, "--identity-path",
                                      "s.id", "--relay-service")
    service.wait_for_line(r"relay check: a relayed stream carried 512 KiB", 5)
    assert relay_serves(maddrs[0], 30) is True
    _, plain = start_bootstrap(procs, tmp_path, "plain", "--host-maddrs", LOOPBACK, "--identity-path", "p.id")
    assert relay_serves(plain[0], 30) is False


def test_a_relay_under_default_limits_is_started_again_a_bounded_number_of_times(monkeypatch, caplog):
    """_relay_ok: a reset stream asks for another start until the last of RELAY_TRIES, which is kept with an
    ERROR line; an unknown verdict keeps the start with a WARNING."""
    import bootstrap.cli as cli
    import peer.net.plumbing.relay_check as relay_check

    verdicts = iter([False, False, False, None])
    monkeypatch.setattr(relay_check, "relay_serves", lambda maddr, timeout: next(verdicts))
    maddrs = ["/ip4/10.0.0.1/tcp/1/p2p/Qm", "/ip4/127.0.0.1/tcp/1/p2p/Qm"]
    assert [cli._relay_ok(maddrs, attempt, 1.0) for attempt in range(1, cli.RELAY_TRIES + 1)] == [False, False, True]
    assert "still reset after 128 KiB after 3 starts" in caplog.text
    assert cli._relay_ok(maddrs, 1, 1.0)
    assert "whether relayed streams carry more than 128 KiB is not known" in caplog.text


def test_the_relay_check_says_it_cannot_tell_when_the_relay_does_not_answer():
    """A relay that accepts no connection (a node still starting, or gone): p2pd fails to connect to it, again
    until the deadline; the check answers None ("could not tell") instead of raising."""
    from peer.net.plumbing.relay_check import relay_serves

    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmV7UHG6LHkBhUCHAfSgbmoYJ5pUeGVGjh13LsGCYDpanT"  # (port 9: refused)
    assert relay_serves(nobody, 1.5) is None
