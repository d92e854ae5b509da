"""``swarm-peer doctor``: what a volunteer checks before joining, as a checklist with a fix for each problem.

Each check is a :class:`Check` (passed, what was found, how to fix it). Local checks first (versions, the device
and its memory, the run dir and its disk, the model and the data), then the network: each initial peer dialed
alone, then a throw-away DHT node that pings them (clock skew, from their DHT time) and reads this run's progress
records (who is training it). Reachability from outside is judged from the addresses this peer would announce;
a dial-back by another peer is not done (docs/architecture.md, "The owner's controls").
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from peer.config import PeerConfig
from peer.config.fields import auto_outer_step
from peer.errors import SetupError
from peer.local import memory
from peer.local.inner import TRITON_MIN_CAPABILITY, compile_wanted
from peer.outer.codec import SPARSE_CODECS
from peer.run import preflight
from peer.run.local_build import memory_setting
from peer.run.run_dir import RunDirLock

CLOCK_TOLERANCE_S = 3.0  # hivemind refuses a DHT peer whose time differs by more (MAX_DHT_TIME_DISCREPANCY_SECONDS)
# bytes per parameter of one checkpoint: fp32 weights, AdamW's two moments, the outer G and v (E, u when used)
CHECKPOINT_BYTES_PER_PARAM = 4 * (1 + 2 + 2)


class CheckVerdict(enum.StrEnum):
    """How one :class:`Check` came out."""

    OK = "ok"
    WARN = "warn"  # works, but worth knowing (not a failure)
    FAIL = "fail"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    verdict: CheckVerdict
    found: str
    fix: str = ""


def run_checks(cfg: PeerConfig, *, network: bool = True, timeout: float = 10.0,
               on_check: Callable[[Check], None] = lambda c: None) -> list[Check]:
    """Every check, in order; ``on_check`` sees each as it ends (the CLI prints it at once)."""
    checks: list[Check] = []

    def add(check: Check) -> None:
        checks.append(check)
        on_check(check)

    add(_versions())
    add(_device(cfg))
    model_check, params = _model(cfg)
    add(model_check)
    add(_data(cfg))
    add(_outer(cfg))
    add(_memory(cfg))
    add(_run_dir(cfg))
    add(_disk(cfg, params))
    if not network:
        add(_reachable_from_outside(cfg))
    else:
        for check in _network(cfg, timeout):
            add(check)
    return checks


# ---- local ----------------------------------------------------------------------------------------------------
def _versions() -> Check:
    import hivemind

    cuda = torch.version.cuda or "none (CPU build)"
    return Check("versions", CheckVerdict.OK,
                 f"torch {torch.__version__} (CUDA {cuda}), hivemind {hivemind.__version__}")


def _device(cfg: PeerConfig) -> Check:
    name = cfg.inner.device
    try:
        preflight.check_device(name)
    except SetupError as e:
        return Check("device", CheckVerdict.FAIL, str(e), "use --inner-device cpu, or install the driver / CUDA torch")
    if name == "cpu" or not torch.cuda.is_available():
        hint = "" if name == "cpu" else "no CUDA device: auto trains on the CPU"
        return Check("device", CheckVerdict.OK if name == "cpu" else CheckVerdict.WARN, f"CPU: {os.cpu_count()} cores, "
                     f"inner.threads {cfg.inner.threads or 'default'}", hint)
    index = _cuda_index(cfg)
    free, total = torch.cuda.mem_get_info(index)
    verdict, steps, hint = compiled_steps(cfg.inner.compile, torch.device("cuda", index))
    return Check("device", verdict, f"{torch.cuda.get_device_name(index)}: {free / 2**30:.1f} GiB free of "
                 f"{total / 2**30:.1f} GiB; {steps}", hint)


def compiled_steps(choice: str, device: torch.device) -> tuple["CheckVerdict", str, str]:
    """What ``inner.compile`` gives on ``device``: the verdict, what the steps will be, and a hint where ``auto``
    finds no Triton on a CUDA card (its steps then run eagerly, about half as fast on an H100 at 100M)."""
    if compile_wanted(choice, device):
        return CheckVerdict.OK, f"steps compiled (inner.compile = {choice})", ""
    if choice == "auto" and device.type == "cuda":
        if torch.cuda.get_device_capability(device) < TRITON_MIN_CAPABILITY:
            return CheckVerdict.OK, "steps eager (Triton does not support this card)", ""
        return CheckVerdict.WARN, "steps eager: no Triton for torch.compile", \
            "install triton (a CUDA build of torch for Linux ships it), or set inner.compile = off to keep eager steps"
    return CheckVerdict.OK, f"steps eager (inner.compile = {choice})", ""


def _model(cfg: PeerConfig) -> tuple[Check, Optional[int]]:
    try:
        params = preflight.check_model(cfg)
    except SetupError as e:
        return Check("model", CheckVerdict.FAIL, str(e), "fix the model setting named above"), None
    return Check("model", CheckVerdict.OK, f"{params:,} parameters; forward returns logits"), params


def _data(cfg: PeerConfig) -> Check:
    try:
        source = preflight.open_data(cfg, max(0, cfg.data.shard))
    except SetupError as e:
        return Check("data", CheckVerdict.FAIL, str(e),
                     "fix data.paths / data.vocab_size, or run swarm-peer prepare-data")
    return Check("data", CheckVerdict.OK, f"{cfg.data.source}: readable, ids within the vocabulary of "
                 f"{cfg.data.vocab_size} (shard {source.shard_index})")


def _outer(cfg: PeerConfig) -> Check:
    """The run's outer optimizer for its codec: DiLoCo's Nesterov for dense codecs; a warning where a sparse codec
    runs with more momentum than it wants (its error feedback delivers a backlog at once, which momentum keeps
    pushing). The run's setting, not this peer's: the fix is its operator's."""
    o = cfg.outer
    lr, momentum = o.nesterov
    found = f"{o.codec}, outer Nesterov lr {lr:g}, momentum {momentum:g}"
    wanted_lr, wanted_momentum = auto_outer_step(o.codec)
    if o.codec not in SPARSE_CODECS or momentum <= wanted_momentum:
        return Check("outer", CheckVerdict.OK, found)
    return Check("outer", CheckVerdict.WARN, f"{found}: a sparse codec's shared model learns far slower with this "
                 "much momentum", f"the run's operator: set outer.lr and outer.momentum = auto ({wanted_lr:g} and "
                 f"{wanted_momentum:g} with this codec; README, \"Which codec for your uplink\")")


def _memory(cfg: PeerConfig, budget: Optional[int] = None, on_cuda: Optional[bool] = None) -> Check:
    """The peak memory of an inner step (peer/local/memory.py) against the card's memory on CUDA or the host's RAM,
    and, where it does not fit, the settings or presets that do. ``budget`` and ``on_cuda``: the memory and device
    to judge against (default: this machine's)."""
    m = cfg.model
    if m.factory or m.hf_config or m.preset not in memory.PRESETS:
        return Check("memory", CheckVerdict.OK, "not estimated for a model of your own (model.factory / hf_config)")
    if on_cuda is None:
        on_cuda = cfg.inner.device != "cpu" and torch.cuda.is_available()
    if budget is None:
        budget = (torch.cuda.mem_get_info(_cuda_index(cfg))[1] if on_cuda
                  else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    where = "of the card's" if on_cuda else "of the host's"
    constants = memory.CUDA if on_cuda else memory.CPU
    usable = int(memory.HEADROOM * budget)
    wanted = cfg.outer.state_on_device
    on_device: bool | str = ("rolling" if wanted == "rolling" else wanted == "on") if on_cuda else False
    ours = memory_setting(cfg, state_on_device=on_device)
    guess = memory.estimate(ours, constants)
    found = (f"{m.preset} at batch {ours.batch_size} x {ours.seq_len} ({ours.describe()}): about "
             f"{guess.total / memory.GIB:.1f} GiB at the peak, {budget / memory.GIB:.1f} GiB {where}")
    if guess.total <= usable:
        return Check("memory", CheckVerdict.OK, found)
    option = next(memory.ways_to_fit(ours, usable, constants), None)
    if option is not None:
        return Check("memory", CheckVerdict.FAIL, found, f"it fits with {option[0].describe()} (about "
                     f"{option[1].total / memory.GIB:.1f} GiB): set data.micro_batch, "
                     f"model.activation_checkpointing, outer.state_on_device and inner.optimizer so")
    smaller = [p for p in memory.PRESETS if next(memory.ways_to_fit(dataclasses.replace(ours, preset=p), usable,
                                                                     constants), None) is not None]
    return Check("memory", CheckVerdict.FAIL, found, "no setting of this preset fits; presets that fit: "
                 + (", ".join(smaller) or "none at this batch size and sequence length"))


def _cuda_index(cfg: PeerConfig) -> int:
    name = cfg.inner.device
    return int(name.partition(":")[2] or 0) if name.startswith("cuda") else 0


def _run_dir(cfg: PeerConfig) -> Check:
    run_dir = Path(cfg.run.run_dir)
    lock = RunDirLock(run_dir)
    try:
        lock.acquire()
    except RuntimeError as e:
        return Check("run dir", CheckVerdict.FAIL, str(e),
                     "stop that peer (swarm-peer finish) or use another --run-dir")
    except OSError as e:
        return Check("run dir", CheckVerdict.FAIL, f"{run_dir}: {e.strerror or e}", "use a writable --run-dir")
    lock.release()
    return Check("run dir", CheckVerdict.OK, f"{run_dir.resolve()} is writable and not in use")


def _disk(cfg: PeerConfig, params: Optional[int]) -> Check:
    where = Path(cfg.run.run_dir)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if params is None:
        return Check("disk", CheckVerdict.WARN, f"{free / 2**30:.1f} GiB free (model size unknown)")
    # keep + 1: the newest ones are kept, and a new one is written before the oldest is deleted
    need = (cfg.run.checkpoint_keep + 1) * CHECKPOINT_BYTES_PER_PARAM * params
    verdict = CheckVerdict.OK if free >= need else CheckVerdict.FAIL
    return Check("disk", verdict, f"{free / 2**30:.2f} GiB free, {cfg.run.checkpoint_keep + 1} checkpoints need about "
                 f"{need / 2**30:.2f} GiB", "" if verdict is CheckVerdict.OK else
                 "free some space, or lower run.checkpoint_keep, or use a --run-dir on a larger disk")


def _reachable_from_outside(cfg: PeerConfig) -> Check:
    sw = cfg.swarm
    if sw.client_mode:
        return Check("reachability", CheckVerdict.OK, "client mode: this peer dials out only (it reduces no span)")
    announced = list(sw.announce_maddrs) or [m for m in sw.host_maddrs if not re.search(r"/ip4/0\.0\.0\.0/", m)]
    ips = [ipaddress.ip_address(m.split("/")[2]) for m in announced if re.match(r"^/ip[46]/", m)]
    public = [ip for ip in ips if ip.is_global]
    fixed_port = any(re.search(r"/tcp/[1-9]\d*", m) for m in sw.host_maddrs)
    if public and fixed_port:
        return Check("reachability", CheckVerdict.OK, f"announces {', '.join(map(str, public))} on a fixed port (not "
                     f"dialed back: make sure the port is forwarded to this machine)")
    if ips and all(ip.is_loopback for ip in ips):
        return Check("reachability", CheckVerdict.WARN,
                     "listens on loopback only: only peers on this machine can dial it",
                     "for a swarm beyond this machine: --host-maddrs /ip4/0.0.0.0/tcp/PORT")
    return Check("reachability", CheckVerdict.WARN, "no public address announced: peers behind other NATs may not dial "
                 "this one", "forward a port and pass --host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs "
                 "/ip4/PUBLIC_IP/tcp/PORT, or run with --client-mode")


# ---- network --------------------------------------------------------------------------------------------------
def _network(cfg: PeerConfig, timeout: float) -> list[Check]:
    sw = cfg.swarm
    if not sw.initial_peers:
        return [Check("bootstrap", CheckVerdict.OK if sw.new_swarm else CheckVerdict.FAIL,
                      "new swarm: no initial peers" if sw.new_swarm else "no initial peers given",
                      "" if sw.new_swarm else "pass --initial-peers (the line swarm-bootstrap prints)")]
    from peer.net.plumbing.reachability import diagnose_initial_peers

    out = []
    answers = diagnose_initial_peers(sw.initial_peers, ["/ip4/0.0.0.0/tcp/0"], timeout=timeout)
    for line in answers:
        address, _, why = line.partition(": ")
        ok = why.startswith("answers")
        out.append(Check("bootstrap", CheckVerdict.OK if ok else CheckVerdict.FAIL,
                         f"{address}: answers" if ok else line,
                         "" if ok else
                         "check the address (swarm-bootstrap prints it), that the node runs and its port is open"))
    if not any(c.verdict is CheckVerdict.OK for c in out):
        return out + [_reachable_from_outside(cfg)]
    return out + [_dialed_back(cfg, timeout)] + _swarm_view(cfg, timeout)


NAT_FIX = ("forward the port to this machine and pass --host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs "
           "/ip4/PUBLIC_IP/tcp/PORT, or run with --client-mode (you still train; you reduce no span); a peer that "
           "finds this at start joins in client mode on its own (swarm.reachability_check)")


def _dialed_back(cfg: PeerConfig, timeout: float) -> Check:
    """Whether an initial peer can open a new connection to where this peer will listen
    (peer/net/plumbing/dial_back.py); judged from the addresses when none of them answers dial-back requests."""
    from peer.net.plumbing.dial_back import not_dialable
    from peer.net.probe import ask_to_be_dialed

    if cfg.swarm.client_mode:
        return _reachable_from_outside(cfg)
    try:
        reply, mine = ask_to_be_dialed(cfg, timeout=timeout)
    except Exception as e:  # the daemon could not listen there (a port in use: is a peer running?)
        return Check("reachability", CheckVerdict.FAIL, f"could not listen on {' '.join(cfg.swarm.host_maddrs)}: "
                     f"{type(e).__name__}: {str(e)[:200]}", "free the port (stop the peer that uses it) or pick "
                     "another in --host-maddrs")
    if reply is None:
        return _reachable_from_outside(cfg)
    if reply.reachable:
        return Check("reachability", CheckVerdict.OK, f"an initial peer dialed this machine back at {reply.address}")
    natted = not_dialable(reply, mine)
    if natted and not reply.dialed:
        return Check("reachability", CheckVerdict.FAIL, f"nobody outside can dial this machine: {natted}", NAT_FIX)
    if not reply.dialed:  # no node would try: say why, and judge from the addresses
        judged = _reachable_from_outside(cfg)
        return Check("reachability", CheckVerdict.WARN,
                     f"no initial peer would dial this machine back ({reply.error}); "
                     f"from the addresses: {judged.found}", judged.fix)
    return Check("reachability", CheckVerdict.FAIL, f"an initial peer could not dial this machine back: {reply.error}",
                 NAT_FIX)


def _swarm_view(cfg: PeerConfig, timeout: float) -> list[Check]:
    """Clock skew against the initial peers and this run's live peers, from a throw-away DHT client."""
    from peer.net.probe import probe_swarm

    try:
        probe = probe_swarm(cfg, timeout=timeout)
    except Exception as e:  # the DHT did not come up: the bootstrap checks above say why, if they can
        return [Check("swarm", CheckVerdict.FAIL, f"could not join the DHT: {type(e).__name__}: {e}",
                      "see the bootstrap checks above")]
    checks = []
    for peer, skew, rtt in probe.clocks:
        ok = abs(skew) <= CLOCK_TOLERANCE_S
        checks.append(Check("clock", CheckVerdict.OK if ok else CheckVerdict.FAIL, f"{skew:+.2f} s against {peer[-8:]} "
                            f"(+-{rtt / 2:.2f} s)", "" if ok else
                            "synchronize this machine's clock (enable NTP: timedatectl set-ntp true)"))
    if not probe.clocks:
        checks.append(Check("clock", CheckVerdict.WARN, "no initial peer answered a ping: clock not compared"))
    live = probe.live_peers
    checks.append(Check("swarm", CheckVerdict.OK if live else CheckVerdict.WARN,
                        f"{live} peer(s) of this run (hash {cfg.run_hash()}) live" +
                        (f", at steps {probe.steps}" if probe.steps else ""),
                        "" if live else "nobody trains this run yet (or another config: compare the run hash)"))
    return checks


def summary(checks: list[Check]) -> tuple[int, str]:
    """Exit status (0 when nothing failed) and one closing line."""
    failed = [c for c in checks if c.verdict is CheckVerdict.FAIL]
    warned = [c for c in checks if c.verdict is CheckVerdict.WARN]
    if failed:
        return 1, f"{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}"
    return 0, "ready to join" + (f" ({len(warned)} warning(s))" if warned else "")
