"""Docker files (docker/): the compose swarm's structure, the commands its services run (parsed by our
own CLIs with the environment they get), the Dockerfile against `make install`, and swarm-docker's
run slots and health check. No Docker engine needed: nothing is built or pulled."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import base58
import pytest
import yaml

from bootstrap.cli import parse_args as bootstrap_parse_args
from peer.cli.swarm_peer import build_parser, parse_overrides
from peer.config import iter_fields
from peer.config.load import build_config, env_name

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
PEER_SERVICES = ("peer", "peer-gpu")
FAKE_PEER_ID = base58.b58encode(b"\x12\x20" + hashlib.sha256(b"bootstrap").digest()).decode()  # Qm...
MADDR_WITH_PEER = re.compile(r"^/ip4/\d+\.\d+\.\d+\.\d+/tcp/\d+/p2p/Qm[1-9A-HJ-NP-Za-km-z]{44}$")


def load_glue():
    spec = importlib.util.spec_from_file_location("swarm_docker", DOCKER / "swarm_docker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


glue = load_glue()
PARSER = build_parser()  # building it reads every field's docstring (slow): build once, reuse


@pytest.fixture(autouse=True)
def one_parser(monkeypatch):
    import peer.cli.swarm_peer

    monkeypatch.setattr(peer.cli.swarm_peer, "build_parser", lambda: PARSER)  # what swarm-docker imports, too


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def env_file(path: Path = DOCKER / ".env") -> dict[str, str]:
    """Compose's .env format as we use it: KEY=VALUE lines, # comments, no quoting."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key), f"bad .env line {line!r}"
            assert not value.startswith(("'", '"')) and " #" not in value, f"keep .env values plain: {line!r}"
            out[key] = value
    return out


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in (DOCKER / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            lines.append(current.strip())
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def image_env() -> dict[str, str]:
    out = {}
    for instruction, args in dockerfile():
        if instruction == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                out[key] = value
    return out


def mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """container path -> (named volume, read-only)"""
    out = {}
    for spec in service.get("volumes", []):
        parts = spec.split(":")
        out[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return out


def on_volume(path: str, service: dict, tmp_path: Path) -> Path:
    """Where a container path lives: it must be on one of the service's named volumes (tmp_path/<volume>)."""
    for target, (volume, _) in mounts(service).items():
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return tmp_path / volume / os.path.relpath(path, target)
    raise AssertionError(f"{path} is not on a volume of the service: it would not survive the container")


def service_env(name: str, tmp_path: Path) -> dict[str, str]:
    """The environment a service's process gets: image ENV < env_file < environment, with the glue's
    container paths moved onto tmp_path/<volume>."""
    service = compose()["services"][name]
    env = dict(image_env())
    if service.get("env_file"):
        assert service["env_file"] == ".env"
        env.update(env_file())
    env.update({k: str(v) for k, v in service.get("environment", {}).items()})
    for key in ("SWARMLOCO_RUN_SLOTS", "SWARMLOCO_BOOTSTRAP_FILE"):
        if key in env:
            env[key] = str(on_volume(env[key], service, tmp_path))
    return env


def run_bootstrap_glue(tmp_path: Path) -> tuple[dict, list[str]]:
    """What the bootstrap service's entrypoint does, with a fake identity; returns (env, identity paths)."""
    service = compose()["services"]["bootstrap"]
    asked = []

    def fake_peer_id(path):
        asked.append(path)
        return FAKE_PEER_ID

    env = glue.prepare_bootstrap(service["command"], service_env("bootstrap", tmp_path), peer_id_of=fake_peer_id,
                                 ip="172.30.0.2", hostname=service["hostname"])
    return env, asked


# ------------------------------------------------------------------------------------------ compose.yaml

def test_compose_services_volumes_and_healthchecks():
    doc = compose()
    services = doc["services"]
    assert {"bootstrap", "peer", "peer-gpu"} <= set(services)
    named = set(doc["volumes"])
    for name, service in services.items():
        for volume, _ in mounts(service).values():
            assert volume in named, f"{name}: {volume} is not a named volume"
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1:3] == ["swarm-docker", "health"], name
        assert service.get("init") is True, f"{name}: an init process reaps p2pd and forwards signals"
        assert "container_name" not in service, f"{name}: a fixed name prevents --scale"
        assert service["entrypoint"][0] == "swarm-docker"
    for name in PEER_SERVICES:
        assert services[name]["depends_on"] == {"bootstrap": {"condition": "service_healthy"}}
        grace = re.fullmatch(r"(\d+)s", services[name]["stop_grace_period"])
        assert grace and int(grace[1]) >= 30, "time to finish the step, checkpoint and leave the DHT"
    assert services["peer"]["deploy"]["replicas"] >= 2
    assert "profiles" not in services["peer"] and "profiles" not in services["bootstrap"]  # the CPU default


def test_compose_gpu_profile():
    service = compose()["services"]["peer-gpu"]
    assert service["profiles"] == ["gpu"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert service["build"]["args"]["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
    assert service["image"] != compose()["services"]["peer"]["image"]  # the CUDA image, not the CPU one
    assert mounts(service)["/data"][0] != mounts(compose()["services"]["peer"])["/data"][0]


def test_compose_builds_from_the_repo_root():
    for name, service in compose()["services"].items():
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == REPO, name
        assert (context / build["dockerfile"]).resolve() == DOCKER / "Dockerfile", name


def test_bootstrap_identity_and_port_are_fixed(tmp_path):
    service = compose()["services"]["bootstrap"]
    args = bootstrap_parse_args(service["command"], env=service_env("bootstrap", tmp_path))
    # The identity is on the bootstrap's own named volume, so the peer id (and address) is stable.
    volume = on_volume(args.identity_path, service, tmp_path).relative_to(tmp_path).parts[0]
    assert volume == "bootstrap-identity"
    assert not mounts(service)["/data"][1]
    port = glue.fixed_listen_port(args.host_maddrs)
    assert args.host_maddrs == [f"/ip4/0.0.0.0/tcp/{port}"]
    published = [p.rsplit(":", 1)[-1] for p in service["ports"]]
    assert str(port) in published
    assert service["hostname"] == "bootstrap"  # the name written to the address file, resolvable by peers


def test_bootstrap_glue_writes_its_address_and_announces_itself(tmp_path):
    env, asked = run_bootstrap_glue(tmp_path)
    assert asked == ["/data/bootstrap.id"]
    written = Path(env["SWARMLOCO_BOOTSTRAP_FILE"]).read_text().split()
    assert written == [f"/dns4/bootstrap/tcp/31337/p2p/{FAKE_PEER_ID}"]
    args = bootstrap_parse_args(compose()["services"]["bootstrap"]["command"], env=env)
    assert args.announce_maddrs == ["/ip4/172.30.0.2/tcp/31337"]  # not loopback
    # the address volume is shared: written by the bootstrap, read-only in the peers
    assert mounts(compose()["services"]["bootstrap"])["/shared"] == ("bootstrap-address", False)
    for name in PEER_SERVICES:
        assert mounts(compose()["services"][name])["/shared"] == ("bootstrap-address", True)


@pytest.mark.parametrize("name", PEER_SERVICES)
def test_peer_command_parses_with_the_env_it_gets(tmp_path, name):
    run_bootstrap_glue(tmp_path)  # the file the peers read
    service = compose()["services"][name]
    argv = service["command"]
    resolve = {"bootstrap": "172.30.0.2"}.__getitem__  # the compose network's DNS
    env, lock_fd = glue.prepare_peer(argv, service_env(name, tmp_path), resolve=resolve, ip="172.30.0.7", wait=0)
    try:
        ns = PARSER.parse_args(argv)
        assert ns.command == "run"
        cfg = build_config(ns.config, parse_overrides(ns), environ=env)  # no ConfigError
        assert cfg.swarm.initial_peers == [f"/ip4/172.30.0.2/tcp/31337/p2p/{FAKE_PEER_ID}"]
        assert all(MADDR_WITH_PEER.match(m) for m in cfg.swarm.initial_peers)
        assert cfg.swarm.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"]
        assert cfg.swarm.announce_maddrs == ["/ip4/172.30.0.7/tcp/31337"]
        volume = "peer-data" if name == "peer" else "peer-gpu-data"
        assert Path(cfg.run.run_dir) == tmp_path / volume / "peer-0"
        assert Path(cfg.run.log_json) == tmp_path / volume / "peer-0" / "events.jsonl"
        assert cfg.identity_path.parent == Path(cfg.run.run_dir)  # the peer id lives with its checkpoints
        assert cfg.inner.device == ("cpu" if name == "peer" else "cuda")
        if name == "peer":
            assert cfg.swarm.min_peers <= service["deploy"]["replicas"]
        # the health check finds the same run dir: nothing yet, then a status line
        assert not glue.check_peer(argv, env, max_age=60)[0]
        (Path(cfg.run.run_dir) / "peer.log").write_text("status\n")
        assert glue.check_peer(argv, env, max_age=60)[0]
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def test_cpu_and_gpu_peers_share_one_run(tmp_path):
    """peer-gpu must group with the CPU peers: same run hash (device and threads are local choices)."""
    hashes = set()
    for name in PEER_SERVICES:
        env = service_env(name, tmp_path)
        env["SWARM_INITIAL_PEERS"] = f"/ip4/10.0.0.1/tcp/31337/p2p/{FAKE_PEER_ID}"
        ns = PARSER.parse_args(compose()["services"][name]["command"])
        hashes.add(build_config(ns.config, parse_overrides(ns), environ=env).run_hash())
    assert len(hashes) == 1


def test_env_file_holds_only_config_keys():
    names = {env_name(section, key) for section, key, _ in iter_fields()}
    env = env_file()
    unknown = [k for k in env if k.startswith("SWARM_") and k not in names]
    assert not unknown, f"not config keys (build_config would silently ignore them): {unknown}"
    # set by compose.yaml / swarm-docker; in .env they would pin every replica to one address or run dir
    for key in ("SWARM_HOST_MADDRS", "SWARM_ANNOUNCE_MADDRS", "SWARM_RUN_DIR", "SWARM_LOG_JSON",
                "SWARM_IDENTITY_PATH", "SWARM_INITIAL_PEERS", "SWARM_NEW_SWARM"):
        assert key not in env, key
    assert float(env["SWARMLOCO_HEALTH_MAX_AGE"]) > 0


def test_explicit_initial_peers_win_over_the_bootstrap_file(tmp_path):
    env = service_env("peer", tmp_path)
    env["SWARM_INITIAL_PEERS"] = f"/ip4/198.51.100.1/tcp/4000/p2p/{FAKE_PEER_ID}"
    out, fd = glue.prepare_peer(["run"], env, resolve=lambda h: pytest.fail("must not resolve"), ip="", wait=0)
    os.close(fd)
    assert out["SWARM_INITIAL_PEERS"] == env["SWARM_INITIAL_PEERS"]
    out, fd = glue.prepare_peer(["run", "--new-swarm"], service_env("peer", tmp_path), ip="", wait=0)
    os.close(fd)
    assert "SWARM_INITIAL_PEERS" not in out
    with pytest.raises(glue.PrepareError, match="bootstrap address file"):  # no file, no peers: a clear error
        glue.prepare_peer(["run", "--run-dir", str(tmp_path / "r")], service_env("peer", tmp_path), ip="", wait=0)


# ------------------------------------------------------------------------------------------ Dockerfile

def test_dockerfile_image_settings():
    instructions = dockerfile()
    kinds = [kind for kind, _ in instructions]
    args = {kind: value for kind, value in instructions}  # the last of each
    user_at = kinds.index("USER")
    assert args["USER"] not in ("root", "0") and not args["USER"].startswith(("root:", "0:"))
    assert user_at > max(i for i, (k, v) in enumerate(instructions) if k == "RUN"), "install as root, run as user"
    assert json.loads(args["VOLUME"]) == ["/data"]
    assert json.loads(args["ENTRYPOINT"]) == ["swarm-peer"]
    assert json.loads(args["CMD"]) == ["run", "--help"]
    assert json.loads(args["HEALTHCHECK"].split(" CMD ", 1)[1]) == ["swarm-docker", "health"]
    env = image_env()
    assert env["SWARM_RUN_DIR"] == "/data" and env["SWARM_LOG_JSON"].startswith("/data/")
    assert f"{glue.fixed_listen_port([env['SWARM_HOST_MADDRS']])}/tcp" == args["EXPOSE"]
    assert "SWARM_IDENTITY_PATH" not in env  # it would be shared by the peer and the bootstrap node
    base = next(v for k, v in instructions if k == "ARG" and v.startswith("BASE_IMAGE="))
    version = re.match(r"BASE_IMAGE=python:3\.(\d+)-slim$", base)
    assert version and int(version[1]) >= 11, "peer/config/load.py needs tomllib (3.11)"
    assert ("FROM", "${BASE_IMAGE}") in instructions


def test_dockerfile_copies_exist_and_pass_the_ignore_file():
    allowed = [line[1:].rstrip("/") for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for kind, value in dockerfile():
        if kind == "COPY":
            *sources, _dest = [a for a in value.split() if not a.startswith("--")]
            for src in sources:
                assert (REPO / src).exists(), src
                assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} excluded from the context"


def _pip_install(command: str) -> dict:
    """The parts of one `python -m pip install ...` command that decide what gets installed."""
    tokens = shlex.split(command)
    at = tokens.index("install")
    assert tokens[at - 2:at] == ["-m", "pip"], f"run pip as `python -m pip`: {command}"
    opts, targets, rest = {}, [], iter(tokens[at + 1:])
    for tok in rest:
        if tok in ("-c", "--constraint", "--index-url", "--extra-index-url", "-r"):
            opts[tok] = next(rest)
        elif tok.startswith("-"):
            opts[tok] = True
        else:
            targets.append(tok)
    return {"opts": opts, "targets": targets}


def _project_target(targets: list[str]) -> tuple[str, set[str]]:
    assert len(targets) == 1, targets
    m = re.fullmatch(r"(\.)(?:\[([\w,]+)\])?", targets[0])
    assert m, targets
    return m[1], set(filter(None, (m[2] or "").split(",")))


def test_dockerfile_installs_like_make_install():
    make = [line for line in (REPO / "Makefile").read_text().splitlines() if "-m pip install" in line]
    assert len(make) == 1
    make_pip = _pip_install(make[0].replace("$(BIN)/python", "python"))
    runs = [v for k, v in dockerfile() if k == "RUN"]
    pips = [_pip_install(part) for run in runs for part in re.split(r"&&|;|\bthen\b", run)
            if "pip install" in part]
    project = [p for p in pips if any(t.startswith(".") for t in p["targets"])]
    assert len(project) == 1, "one project install, as in the Makefile"
    docker_pip = project[0]
    # same constraints file; same project; extras: the image takes none the Makefile does not ([dev] adds tests)
    assert docker_pip["opts"]["-c"] == make_pip["opts"]["-c"] == "constraints.txt"
    (make_path, make_extras), (docker_path, docker_extras) = (_project_target(make_pip["targets"]),
                                                              _project_target(docker_pip["targets"]))
    assert docker_path == make_path == "." and docker_extras <= make_extras
    for flag in ("--no-deps", "-U", "--upgrade", "--pre", "--no-index"):
        assert flag not in docker_pip["opts"]
    assert any("python -m venv" in run for run in runs), "a virtualenv, as `make install`"
    # torch: installed by name only, so constraints.txt decides the version (the one pyproject pins)
    torch_steps = [p for p in pips if "torch" in p["targets"] or any(t.startswith("torch") for t in p["targets"])]
    assert torch_steps and all(p["targets"] == ["torch"] and p["opts"]["-c"] == "constraints.txt" for p in torch_steps)
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch==")]
    project_deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert len(pins) == 1 and pins[0] in project_deps
    index = next(v for k, v in dockerfile() if k == "ARG" and v.startswith("TORCH_INDEX_URL="))
    assert index == "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"  # CPU by default
    assert ("COPY", "constraints.txt ./") in dockerfile()


def test_readme_documents_the_build_commands():
    readme = (REPO / "README.md").read_text()
    assert readme.index("\n## Docker\n") < readme.index("\n## Configuration\n")
    section = readme.split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]
    gpu_index = compose()["services"]["peer-gpu"]["build"]["args"]["TORCH_INDEX_URL"]
    for needle in ("docker build -f docker/Dockerfile -t swarmloco:cpu .", f"TORCH_INDEX_URL={gpu_index}",
                   "docker compose -f docker/compose.yaml up", "--scale peer=", "logs -f peer", "docker kill",
                   "--profile gpu", "--entrypoint swarm-bootstrap"):
        assert needle in section, needle
    dockerfile_text = (DOCKER / "Dockerfile").read_text()
    assert "docker build -f docker/Dockerfile -t swarmloco:cpu ." in dockerfile_text
    assert f"TORCH_INDEX_URL={gpu_index}" in dockerfile_text


# ------------------------------------------------------------------------------------------ swarm-docker

def test_run_slots_are_locked_and_reused(tmp_path):
    a, fd_a = glue.claim_slot(tmp_path)
    b, fd_b = glue.claim_slot(tmp_path)
    assert (a.name, b.name) == ("peer-0", "peer-1")
    # The lock follows its descriptor into another process (as into the exec'd swarm-peer).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], pass_fds=[fd_a])
    try:
        os.close(fd_a)
        c, fd_c = glue.claim_slot(tmp_path)
        assert c.name == "peer-2"  # peer-0 is still held by the child
        os.close(fd_c)
    finally:
        child.kill()
        child.wait()
    again, fd = glue.claim_slot(tmp_path)
    assert again.name == "peer-0"  # freed when its holder died: a restarted container resumes there
    os.close(fd)
    os.close(fd_b)


def test_bootstrap_file_is_waited_for_and_resolved(tmp_path):
    path = tmp_path / "initial-peers"
    with pytest.raises(glue.PrepareError, match="not written yet"):
        glue.read_bootstrap_file(path, wait=0, resolve=lambda h: "10.0.0.1")
    path.write_text(f"/dns4/bootstrap/tcp/31337/p2p/{FAKE_PEER_ID}\n/ip4/10.9.9.9/tcp/1/p2p/{FAKE_PEER_ID}\n")
    calls = []

    def flaky(host):  # DNS not ready on the first try
        calls.append(host)
        if len(calls) == 1:
            raise socket.gaierror("not yet")
        return "10.0.0.3"

    got = glue.read_bootstrap_file(path, wait=5, resolve=flaky, sleep=lambda s: None)
    assert got == [f"/ip4/10.0.0.3/tcp/31337/p2p/{FAKE_PEER_ID}", f"/ip4/10.9.9.9/tcp/1/p2p/{FAKE_PEER_ID}"]
    assert glue.self_announce(["/ip4/0.0.0.0/tcp/31337"], "172.1.2.3") == "/ip4/172.1.2.3/tcp/31337"
    assert glue.self_announce(["/ip4/0.0.0.0/tcp/0"], "172.1.2.3") is None  # a random port cannot be announced
    assert glue.self_announce(["/ip4/0.0.0.0/tcp/31337"], None) is None


def test_health_of_a_run_dir(tmp_path):
    run = tmp_path / "run"
    assert glue.main(["health", "--run-dir", str(run), "--max-age", "60"]) == 1  # nothing written yet
    run.mkdir()
    (run / "peer.log").write_text("x\n")
    assert glue.main(["health", "--run-dir", str(run), "--max-age", "60"]) == 0
    old = time.time() - 600
    os.utime(run / "peer.log", (old, old))
    assert glue.main(["health", "--run-dir", str(run), "--max-age", "60"]) == 1  # stale: stuck peer
    events = tmp_path / "events.jsonl"
    events.write_text("{}\n")  # a fresh event in the JSON log counts too
    assert glue.main(["health", "--run-dir", str(run), "--log-json", str(events), "--max-age", "60"]) == 0
    # the script as Docker runs it: exit status 0 / 1
    script = [sys.executable, str(DOCKER / "swarm_docker.py"), "health", "--run-dir", str(run), "--max-age", "60"]
    done = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout.startswith("unhealthy:")


def _fake_command(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


def _start(argv, **kwargs):
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, **kwargs)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_health_finds_the_peer_process(tmp_path):
    """The image's HEALTHCHECK reads the running peer's flags, environment and cwd from /proc."""
    script = _fake_command(tmp_path, "swarm-peer", "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "SWARM_LOG_JSON": str(tmp_path / "events.jsonl")}
    proc = _start([sys.executable, str(script), "run", "--new-swarm", "--run-dir", "rel/run"], cwd=work, env=env)
    try:
        check = ["health", "--pid", str(proc.pid), "--max-age", "60"]
        assert glue.main(check) == 1  # nothing written yet
        (tmp_path / "events.jsonl").write_text("{}\n")  # found through the process's environment
        assert glue.main(check) == 0
        old = time.time() - 600
        os.utime(tmp_path / "events.jsonl", (old, old))
        assert glue.main(check) == 1
        (work / "rel" / "run").mkdir(parents=True)
        (work / "rel" / "run" / "peer.log").write_text("x\n")  # relative to the process's cwd
        assert glue.main(check) == 0
    finally:
        proc.kill()
        proc.wait()


def test_health_of_the_bootstrap_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = _fake_command(tmp_path, "swarm-bootstrap", (
        "import socket, sys, time\n"
        f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen()\n"
        "print('ready', flush=True)\ntime.sleep(60)\n"))
    identity = tmp_path / "boot.id"
    argv = [sys.executable, str(script), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity-path", "boot.id"]
    proc = _start(argv, cwd=tmp_path)
    try:
        check = ["health", "bootstrap", "--pid", str(proc.pid)]
        assert glue.main(check) == 1  # no identity yet
        identity.write_bytes(b"key")
        assert glue.main(check) == 0
    finally:
        proc.kill()
        proc.wait()
    identity.unlink()
    # nothing listening any more (and no process): unhealthy
    assert not glue.check_bootstrap(argv[2:], {})[0]
    assert glue.main(["health", "bootstrap", "--pid", str(proc.pid)]) == 1


def test_help_passes_through(tmp_path):
    """`swarm-docker swarm-peer run --help` must reach swarm-peer untouched (no slot, no waiting)."""
    env = service_env("peer", tmp_path)
    out, fd = glue.prepare_peer(["run", "--help"], env, ip="", wait=0)
    assert fd is None and out == env
    out = glue.prepare_bootstrap(["--help"], service_env("bootstrap", tmp_path), peer_id_of=pytest.fail)
    assert "SWARM_ANNOUNCE_MADDRS" not in out


def test_bootstrap_identity_errors_are_one_line(tmp_path):
    def broken(path):
        raise ValueError("not a valid libp2p private key")

    with pytest.raises(glue.PrepareError, match="--identity-path /data/bootstrap.id: not a valid"):
        glue.prepare_bootstrap(compose()["services"]["bootstrap"]["command"], service_env("bootstrap", tmp_path),
                               peer_id_of=broken, ip="", hostname="bootstrap")
