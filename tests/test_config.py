"""Config: precedence, validation, unknown keys, run hash, and the CLI's exit status 2."""

import subprocess
import sys

import pytest

from peer.config import ConfigError
from peer.config.load import build_config
from peer.cli.swarm_peer import main

NEW = {("swarm", "new_swarm"): True}


def test_defaults_and_precedence(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[outer]\nlr = 0.5\nsync_every = 7\n[swarm]\ninitial_peers = ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]\n')
    cfg = build_config(str(toml), {}, environ={"SWARM_OUTER_LR": "0.6"})
    assert cfg.outer.sync_every == 7 and cfg.outer.lr == 0.6  # env beats TOML
    cfg = build_config(str(toml), {("outer", "lr"): 0.9}, environ={"SWARM_OUTER_LR": "0.6"})
    assert cfg.outer.lr == 0.9  # flag beats env
    assert cfg.swarm.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]


def test_env_list_and_bool():
    cfg = build_config(None, {}, environ={"SWARM_INITIAL_PEERS": "/ip4/a, /ip4/b", "SWARM_CLIENT_MODE": "yes"})
    assert cfg.swarm.initial_peers == ["/ip4/a", "/ip4/b"] and cfg.swarm.client_mode is True


@pytest.mark.parametrize("text, needle", [
    ("[outer]\nlr = -1.0\n", "outer.lr: must be auto or a number > 0"),
    ("[outer]\nlr = \"fast\"\n", "outer.lr: must be auto or a number > 0 (got 'fast')"),
    ("[outer]\nmomentum = true\n", "outer.momentum in"),
    ("[outer]\nbogus = 1\n", "unknown key 'outer.bogus'"),
    ("[nosuch]\nx = 1\n", "unknown section [nosuch]"),
    ("[model]\nseq_len = 'long'\n", "model.seq_len"),
    ("[swarm]\npart_timeout = 90.0\n", "swarm.part_timeout: must be < swarm.allreduce_timeout"),
    ("[swarm]\ndeadlines = 'auto'\n", "swarm.deadlines: must be measured or fixed"),
    ("[swarm]\ndeadline_max = 30.0\n", "swarm.deadline_max: must be >= swarm.allreduce_timeout"),
    ("[swarm]\nrelay_via = ['/ip4/1.2.3.4/tcp/1/p2p/QmX']\nclient_mode = true\n",
     "swarm.relay_via: must be empty with swarm.client_mode or swarm.relay_service"),
    ("not toml [", "is not valid TOML"),
])
def test_bad_files_name_the_key(tmp_path, text, needle):
    toml = tmp_path / "c.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match=None) as err:
        build_config(str(toml), NEW, environ={})
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_initial_peers_is_an_error():
    with pytest.raises(ConfigError, match="--initial-peers is empty"):
        build_config(None, {}, environ={})
    assert build_config(None, NEW, environ={}).swarm.new_swarm


def test_run_hash_covers_shared_settings_only():
    base = build_config(None, NEW, environ={})
    local = build_config(None, {**NEW, ("run", "run_dir"): "/elsewhere", ("data", "batch_size"): 3,
                                ("swarm", "host_maddrs"): ["/ip4/127.0.0.1/tcp/5"]}, environ={})
    shared = build_config(None, {**NEW, ("outer", "lr"): 0.4}, environ={})
    assert base.run_hash() == local.run_hash()
    assert base.run_hash() != shared.run_hash()


def test_the_outer_step_auto_stands_for_each_codecs_and_hashes_as_its_numbers(tmp_path):
    """``auto`` (the default) is DiLoCo's Nesterov 0.7 / 0.9 with a dense codec and 3.0 / 0.5 with a top-k one,
    resolved once the codec is known (a flag, the environment or the file may set either); a number set by hand
    stays; a run that spells out auto's numbers is the same run."""
    def outer(**over):
        return build_config(None, {**NEW, **{("outer", k): v for k, v in over.items()}}, environ={}).outer

    assert outer().nesterov == (0.7, 0.9) and outer(codec="fp8").nesterov == (0.7, 0.9)
    sparse = dict(codec="topk32", error_feedback=True)
    assert outer(**sparse).nesterov == (3.0, 0.5)
    assert outer(**sparse, momentum=0.8).nesterov == (3.0, 0.8) and outer(lr=1.5).nesterov == (1.5, 0.9)
    toml = tmp_path / "c.toml"
    toml.write_text('[outer]\nlr = 2\nmomentum = "auto"\n')
    cfg = build_config(str(toml), NEW, environ={"SWARM_OUTER_CODEC": "topk64", "SWARM_OUTER_ERROR_FEEDBACK": "1"})
    assert cfg.outer.nesterov == (2.0, 0.5) and isinstance(cfg.outer.lr, float)
    by_hand = build_config(None, {**NEW, ("outer", "lr"): 0.7, ("outer", "momentum"): 0.9}, environ={})
    assert by_hand.run_hash() == build_config(None, NEW, environ={}).run_hash()


@pytest.mark.parametrize("argv, needle", [
    (["run", "--new-swarm", "--outer-lr", "abc"], "outer.lr: must be auto or a number > 0 (got 'abc')"),
    (["run", "--new-swarm", "--outer-momentum", "1.5"], "outer.momentum: must be auto or a number in [0, 1)"),
    (["run"], "--initial-peers is empty"),
])
def test_cli_exits_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("swarm-peer: error:")


def test_cli_unknown_key_in_config_file_subprocess(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[inner]\nlearning_rate = 1.0\n")
    proc = subprocess.run([sys.executable, "-m", "peer", "run", "--config", str(toml), "--new-swarm"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown key 'inner.learning_rate'" in proc.stderr
    assert "allowed in [inner]: lr," in proc.stderr


def test_cli_help_works():
    proc = subprocess.run([sys.executable, "-m", "peer", "run", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--initial-peers" in proc.stdout and "SWARM_INITIAL_PEERS" in proc.stdout


def test_codec_names_match_the_codec_registry():
    from peer.outer.codec import CODECS
    from peer.config import CODEC_NAMES

    assert set(CODEC_NAMES) == set(CODECS)


def test_wait_timeout_must_cover_a_round():
    with pytest.raises(ConfigError, match="outer.wait_timeout"):
        build_config(None, {**NEW, ("outer", "wait_timeout"): 10.0}, environ={})


def test_the_outer_state_on_the_device_takes_error_feedback_but_not_tau_equal_to_h():
    sparse = {**NEW, ("outer", "codec"): "topk32", ("outer", "error_feedback"): True}
    for where in ("on", "rolling"):
        cfg = build_config(None, {**sparse, ("outer", "state_on_device"): where}, environ={})
        assert (cfg.outer.state_on_device, cfg.outer.error_feedback) == (where, True)
    with pytest.raises(ConfigError, match=r"outer.state_on_device: must be auto or off with outer.tau = "):
        build_config(None, {**NEW, ("outer", "state_on_device"): "on", ("outer", "tau"): 50,
                            ("outer", "sync_every"): 50}, environ={})


def test_the_per_host_stream_budget_lies_between_the_per_peer_one_and_the_total():
    for bad in (8, 1024):
        with pytest.raises(ConfigError, match=r"max_streams_per_host: must be between swarm.max_streams_per_peer and "):
            build_config(None, {**NEW, ("swarm", "max_streams_per_host"): bad}, environ={})
    assert build_config(None, NEW, environ={}).swarm.max_streams_per_host == 64


def test_the_partners_reserve_leaves_strangers_half_the_streams_at_least():
    for bad in (-0.1, 0.6):
        with pytest.raises(ConfigError, match=r"partner_share: must be between 0 and 0.5"):
            build_config(None, {**NEW, ("swarm", "partner_share"): bad}, environ={})
    small = build_config(None, {**NEW, ("swarm", "max_streams"): 16, ("swarm", "max_streams_per_host"): 16},
                         environ={}).swarm  # (a share: a lower max_streams needs no other change)
    assert small.partner_share == 0.25 and int(small.max_streams * small.partner_share) == 4


def test_progress_ttl_must_outlast_a_stalled_dht():
    """A record reaches the DHT and is read up to one dht_timeout late each while a DHT node is unreachable."""
    with pytest.raises(ConfigError, match=r"progress_ttl: must be > swarm.progress_period \+ 2 \* swarm.dht_timeout"):
        build_config(None, {**NEW, ("swarm", "progress_period"): 5.0, ("swarm", "progress_ttl"): 14.0}, environ={})
    with pytest.raises(ConfigError, match=r"progress_ttl: must be <= 3600 \(DHT nodes keep no record longer\)"):
        build_config(None, {**NEW, ("swarm", "progress_ttl"): 3601.0}, environ={})
    cfg = build_config(None, {**NEW, ("swarm", "progress_period"): 1.0, ("swarm", "progress_ttl"): 8.0,
                              ("swarm", "dht_timeout"): 3.0}, environ={})
    assert cfg.swarm.dht_timeout == 3.0


def test_inner_compile_is_auto_on_or_off_and_reads_an_old_switch(tmp_path):
    """inner.compile: auto by default; a TOML true / false (it was a switch) reads as on / off; a flag or env
    value outside auto, on, off gets the one-line error naming the key."""
    assert build_config(None, NEW, environ={}).inner.compile == "auto"
    toml = tmp_path / "c.toml"
    for text, expected in (("true", "on"), ("false", "off"), ('"off"', "off")):
        toml.write_text(f"[inner]\ncompile = {text}\n")
        assert build_config(str(toml), NEW, environ={}).inner.compile == expected
    assert build_config(None, NEW, environ={"SWARM_INNER_COMPILE": "on"}).inner.compile == "on"
    with pytest.raises(ConfigError) as err:
        build_config(None, NEW, environ={"SWARM_INNER_COMPILE": "yes"})
    assert "inner.compile: must be auto, on, off" in str(err.value) and "\n" not in str(err.value)
