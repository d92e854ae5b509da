#!/bin/bash
# A lent GPU's 15 minutes, spent in order of value (docs/benchmarks.md, "On the H200, 2026-11-27 midday"). Run it
# through the device tool from the checkout, with the kit of ../shared/gpu/ copied to .gpu-kit/ and its wheels
# (plus torchao's) in .whl/:  OUT=$OUT bash bench/gpu_session.sh   (carry: [".gpu-kit", ".whl"]; about 9 minutes).
# Each section writes $OUT/<n>-<name>.txt as soon as it is done, so a call cut short still reports what ran;
# SECTIONS (default: all) picks some, e.g. SECTIONS="tests bench".
set -u
OUT=${OUT:-runs/gpu-session}; mkdir -p "$OUT"
SECTIONS=${SECTIONS:-"tests codec bench rolling fit swarm"}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))'
} > "$OUT/0-env.txt" 2>&1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUT/0-env.txt" 2>&1
  [ -d .whl/pure ] && cp -r .whl/pure/* /tmp/site/ && chmod +x /tmp/site/hivemind/hivemind_cli/p2pd
  export PYTHONPATH=/tmp/site:$PWD
fi
GPU=(python3 bench/gpu.py --device cuda --steps 30 --blocks 2 --skip tests,codec)
if want tests; then say tests | tee "$OUT/1-tests.txt"
  timeout 90 python3 -m pytest -q -rs -p no:cacheprovider tests -k cuda >> "$OUT/1-tests.txt" 2>&1; fi
if want codec; then say codec | tee "$OUT/2-codec.txt"
  timeout 60 python3 bench/codec.py --device cuda --codecs e3m0,fp8,bf16,topk32 >> "$OUT/2-codec.txt" 2>&1; fi
if want bench; then say "bench 1B, every copy on the device" | tee "$OUT/3-bench.txt"
  timeout 200 "${GPU[@]}" --presets 1B --state-on-device on --out "$OUT/3-bench.json" >> "$OUT/3-bench.txt" 2>&1; fi
if want rolling; then say "bench 1B, the rolling residency" | tee "$OUT/4-rolling.txt"
  timeout 200 "${GPU[@]}" --presets 1B --state-on-device rolling --out "$OUT/4-rolling.json" >> "$OUT/4-rolling.txt" 2>&1; fi
if want fit; then say "1B on a 24 GiB card: each loop alone (memory children)" | tee "$OUT/5-fit.txt"
  timeout 150 python3 bench/gpu.py --device cuda --presets 1B --steps 5 --blocks 1 --sync-every 10 --tau 2 --skip tests,codec \
    --micro-batch 2 --activation-checkpointing --optimizer adamw8bit --state-on-device rolling \
    --out "$OUT/5-fit.json" >> "$OUT/5-fit.txt" 2>&1; fi
if want swarm && [ -f .gpu-kit/swarm.toml ]; then say "two peers on the GPU" | tee "$OUT/6-swarm.txt"
  timeout 140 python3 -m peer.cli.demo --config .gpu-kit/swarm.toml --peers 2 --max-steps 120 \
    --run-root /tmp/gpu-swarm --timeout 130 >> "$OUT/6-swarm.txt" 2>&1; fi
say done | tee -a "$OUT/0-env.txt"
