#!/bin/bash
# A lent GPU's 15 minutes, spent in order of value. Run it through the device tool from the checkout, with the kit
# of ../shared/gpu/ copied to .gpu-kit/ and its wheels (plus torchao's) in .whl/:
#   SECTIONS="tests swarm bench1b compile" OUT=$OUT bash bench/gpu_session.sh   (carry: [".gpu-kit", ".whl"])
# Seconds on an H100 (2026-11-28): install 22, tests 40 (the swarm beside them), bench1b 140 without its memory
# children (MEMORY=0), profile 60, bench100m 105, codec 12; a start ~35. On an H200 (2026-11-30): tests with the
# swarm 111, bench1b 201 with its memory children and no profile (PROFILE1B=0), 229 with both (T1B=330: its
# limit), codec 12, stall 45. bench1b's profile prints the training stream's idle gaps and the host op in each.
# Each section writes $OUT/<name>.txt as soon as it is done (a call cut short still reports what ran), one file per
# section because the device tool brings back at most 8; the JSON of the benches stays on the machine.
#   tests     pytest -k cuda                              bench1b   bench/gpu.py 1B, step clock, memory, a profile
#                                                                   of 8 steps from a launch, its trace in traces/
#   profile   bench/gpu.py 100M with a profile of 12 steps            (MEMORY=0: without its memory children)
#   bench100m bench/gpu.py 100M, eager and --compile      compile   bench/gpu.py 1B --compile
#   rolling   1B with the rolling residency               fit       1B on a 24 GiB card (micro-batch, checkpointing,
#   codec     bench/codec.py on the device                          adamw8bit), each loop's memory alone
#   stall     bench/checkpoint_stall.py --device cuda     swarm     two peers on the GPU (.gpu-kit/swarm.toml)
#   sparse    bench/gpu.py 1B with topk32 and error feedback (the device path adds the residual there)
set -u
OUT=${OUT:-runs/gpu-session}; mkdir -p "$OUT"
SECTIONS=${SECTIONS:-"tests swarm bench1b compile"}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; git log --oneline -1
  python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))'
} > "$OUT/0-env.txt" 2>&1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUT/0-env.txt" 2>&1
  [ -d .whl/pure ] && cp -r .whl/pure/* /tmp/site/ && chmod +x /tmp/site/hivemind/hivemind_cli/p2pd
  export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c 'import numba, torchao, peer.outer.engine; print("numba", numba.__version__, "torchao", torchao.__version__)' \
  >> "$OUT/0-env.txt" 2>&1
GPU=(python3 bench/gpu.py --device cuda --steps 30 --blocks 2 --skip tests,codec)
section() {  # name, timeout (s), command...
  local name=$1 limit=$2; shift 2
  [[ " $SECTIONS " == *" $name "* ]] || return 0
  say "$name: $*" | tee -a "$OUT/0-env.txt" > "$OUT/$name.txt"
  timeout "$limit" "$@" >> "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt"
}
# the swarm and the CUDA tests side by side (neither is timed); the benches after them, alone on the device
section swarm 200 python3 -m peer.cli.demo --config .gpu-kit/swarm.toml --peers 2 --max-steps 120 \
  --run-root /tmp/gpu-swarm --timeout 190 &  # (inner.compile = auto: the peers compile first)
section tests 100 python3 -m pytest -q -rs -p no:cacheprovider --continue-on-collection-errors tests -k cuda
wait
skip1b=tests,codec; [ "${MEMORY:-1}" = 0 ] && skip1b=tests,codec,memory  # (1B's memory children: about 80 s)
section profile 120 "${GPU[@]}" --presets 100M --skip tests,codec,memory --profile-steps 12 --out /tmp/profile.json
section bench1b "${T1B:-240}" "${GPU[@]}" --presets 1B --skip $skip1b --profile-steps "${PROFILE1B:-8}" --trace-dir "$OUT/traces" \
  --out /tmp/bench1b.json
section bench100m 200 bash -c "${GPU[*]} --presets 100M --skip tests,codec,memory --out /tmp/b100.json;
  ${GPU[*]} --presets 100M --skip tests,codec,memory --compile --out /tmp/b100c.json"
section compile 240 "${GPU[@]}" --presets 1B --compile --skip tests,codec,memory --out /tmp/compile.json
section rolling 200 "${GPU[@]}" --presets 1B --state-on-device rolling --skip tests,codec,memory --out /tmp/rolling.json
section fit 150 python3 bench/gpu.py --device cuda --presets 1B --steps 5 --blocks 1 --sync-every 10 --tau 2 \
  --skip tests,codec --micro-batch 2 --activation-checkpointing --optimizer adamw8bit --state-on-device rolling \
  --out /tmp/fit.json
section sparse 200 "${GPU[@]}" --presets 1B --codec topk32 --skip tests,codec,memory --out /tmp/sparse.json
section codec 60 python3 bench/codec.py --device cuda --codecs e3m0,fp8,bf16,topk32
section stall 120 python3 bench/checkpoint_stall.py --device cuda --preset 100M --batch 8 --seq-len 1024 --dir /tmp
say done | tee -a "$OUT/0-env.txt"
