#!/usr/bin/env bash
# Everything a session with a lent GPU runs, in one call (device time is scarce: ~15 minutes a
# session, start included). From the repository root on the GPU machine:
#   bash benchmarks/gpu_session.sh [OUT_DIR]
# Builds alpsck for that machine's python (into /tmp/site, nothing installed system-wide), then:
#   1. the GPU tests (tests/gpu/test_gpu.py, pytest -m gpu);
#   2. the staging benchmark (benchmarks/gpu_staging.py): stall vs pinned copy, overlap, restore to GPU;
#   3. bit-exact resume of the reference Llama training on the GPU (crash at step 51, resume, cmp);
#   4. the first save's stall, pool pinned ahead vs in the first save (benchmarks/first_save.py);
#   5. the training-overhead benchmark on the GPU against torch.save and DCP async;
#   6. the memory tier (benchmarks/gpu_memory_tier.py): its saves' stall against the run directory's and
#      the pinned copy, restore into the GPU from memory against the run directory with its pages dropped;
#   7. bit-exact resume of the reference Llama training from the memory tier on the GPU;
#   8. the health gate's node checks on the GPU (its probe, alone and with its GPU kernel), and with
#      another process holding 60 % of the GPU's memory (the gpu check must fail and name it);
#   9. Megatron-LM's checkpoints (benchmarks/gpu_megatron.py): alpsck's dist_checkpointing strategies against
#      Megatron's torch_dist on the GPU, save and load, bit-exact (megatron-core's wheel in .whl/).
# Each step has its own time limit, so one that hangs does not take the others' time. Wheels the
# machine lacks (submitit) travel in .whl/ (see /work/.library/device/README.md).
# ALPSCK_GPU_STEPS="1 6 7" runs those steps only (the build always): a session spends its device
# time on what changed.
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-out}}
steps=" ${ALPSCK_GPU_STEPS:-1 2 3 4 5 6 7} "
want() { [[ "$steps" == *" $1 "* ]]; }
mkdir -p "$out"
root=$(pwd)
bench=/tmp/alpsck-gpu-bench
mkdir -p "$bench"
step() { printf '\n==== %s (%s) ====\n' "$1" "$(date +%T)"; }
status=0
run() {  # run LIMIT_S NAME CMD...: the command's output to the log; its failure counted, not fatal
  local limit=$1 name=$2; shift 2
  step "$name"
  timeout "$limit" "$@" || { echo "!!!! $name failed (exit $?)"; status=1; }
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
nproc; free -g | head -2; df -h /tmp | tail -1

step "build"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . || { echo "build failed"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp || exit 1

want 1 && run 150 "GPU tests" python3 -m pytest -q -p no:cacheprovider -m gpu "$root/tests/gpu"
want 2 && run 150 "staging benchmark" python3 "$root/benchmarks/gpu_staging.py" --dir "$bench" --layers 24 \
  --width 4096 --repeats 3 --json "$out/gpu_staging.json"

llama() { timeout 120 python3 -m alpsck.examples.llama --device cuda --training-steps 70 --checkpoint-freq 25 "$@"; }
bit_exact() {  # bit_exact FAIL_AT [options...]: uninterrupted, crashed at FAIL_AT, resumed: the same losses
  local at=$1; shift
  rm -rf "$bench"/ck-a "$bench"/ck-c "$bench"/a.csv "$bench"/c.csv
  llama --loss-file "$bench/a.csv" --checkpoint-dir "$bench/ck-a" "$@" 2>&1 | tail -2
  llama --loss-file "$bench/c.csv" --checkpoint-dir "$bench/ck-c" --fail-at-step "$at" "$@" 2>&1 | tail -2
  llama --loss-file "$bench/c.csv" --checkpoint-dir "$bench/ck-c" --load-checkpoint "$@" 2>&1 | grep -E "resumed|step 70"
  if cmp "$bench/a.csv" "$bench/c.csv"; then echo "bit-exact: the resumed losses equal the uninterrupted ones"
  else echo "!!!! resumed losses differ"; status=1; diff "$bench/a.csv" "$bench/c.csv" | head; fi
}
if want 3; then step "bit-exact resume on the GPU"; bit_exact 51; fi

want 4 && run 120 "first save" python3 "$root/benchmarks/first_save.py" --device cuda --dir "$bench" --gib 2 --rounds 2 \
  --work-s 3
want 5 && run 200 "training overhead" python3 -m alpsck bench --overhead --device cuda --dir "$bench" --model-dim 1024 \
  --model-layers 8 --model-heads 16 --model-kv-heads 8 --batch-size 16 --seq-len 256 --methods alpsck,torch,dcp-async \
  --ks 5,20 --iters 40 --warmup 3
if want 6 || want 7; then
  step "memory root"
  df -h /dev/shm | tail -1
  # The memory tier needs room for a few copies of the state: a small /dev/shm (a container's 64 MiB) gets a
  # tmpfs of its own where this machine lets root mount one.
  if [ "$(df --output=avail -B1G /dev/shm | tail -1)" -lt 20 ] && mkdir -p /tmp/alpsck-shm \
      && mount -t tmpfs -o size=40g tmpfs /tmp/alpsck-shm; then
    export ALPSCK_MEMORY_ROOT=/tmp/alpsck-shm; echo "memory root: a tmpfs at $ALPSCK_MEMORY_ROOT"
  fi
fi
want 6 && run 200 "memory tier benchmark" python3 "$root/benchmarks/gpu_memory_tier.py" --dir "$bench" --layers 24 \
  --width 4096 --repeats 3 --json "$out/gpu_memory_tier.json"
if want 7; then  # memory snapshots every 5 steps, the run directory every 25: the crash at 58 resumes from 55
  step "bit-exact resume from the memory tier on the GPU"; bit_exact 58 --memory-every 5
fi
if want 8; then
  probe=$(python3 -c 'from alpsck.node_health.probe import CODE; print(CODE)')
  run 60 "node checks (the probe, default thresholds)" python3 -c "$probe" "$bench" '{}'
  run 120 "node checks with the GPU kernel (the probe, twice: the first imports torch)" \
    bash -c 'python3 -c "$1" "$2" "{\"gpu_kernel\": true}"; python3 -c "$1" "$2" "{\"gpu_kernel\": true}"' _ "$probe" "$bench"
  rm -f /tmp/alpsck-held
  python3 -c 'import time, torch; free, total = torch.cuda.mem_get_info(); x = torch.empty(int(total * 0.6),
dtype=torch.uint8, device="cuda"); open("/tmp/alpsck-held", "w").close(); time.sleep(120)' &
  hold=$!
  for _ in $(seq 120); do [ -e /tmp/alpsck-held ] && break; sleep 0.5; done
  step "node checks while another process holds 60 % of the GPU's memory (max_gpu_memory_used 0.2: must fail)"
  python3 -c "$probe" "$bench" '{"max_gpu_memory_used": 0.2}' | tee "$out/node_checks_gpu_held.json"
  grep -q '"name": "gpu", "ok": false' "$out/node_checks_gpu_held.json" || { echo "!!!! gpu not failed"; status=1; }
  kill "$hold" 2>/dev/null
fi
want 9 && run 200 "Megatron checkpoints" python3 "$root/benchmarks/gpu_megatron.py" --dir "$bench/megatron" \
  --layers 8 --hidden 1024 --reps 3 --json "$out/gpu_megatron.json"
step "done (status $status)"
exit $status
