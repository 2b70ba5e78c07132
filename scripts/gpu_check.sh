#!/usr/bin/env bash
# A reduced A100 reproduction on an NVIDIA machine with vLLM: fewer requests, one seed,
# the three policies (unbounded = stock vLLM, dlfp-cadence = the paper, dlfp = completion),
# end to end through `dlfp bench`, in under 8 minutes.
#   bash scripts/gpu_check.sh MODEL       # MODEL: a local folder (no hub needed) or a hub name
# Environment (all optional):
#   PY=python           the interpreter with dlfp, vllm==0.32.0 and nvidia-ml-py installed
#   PROFILE=a100-paper  device profile (the paper's parameters; h200 for an H200)
#   REQUESTS=12 WARMUP=1 SEED=801 RATE=1.0 SCALE=1.0 OUT=runs/gpu-check
#   DLFP_VLLM_ENGINE_ARGS='{"enforce_eager": true}'  extra vLLM engine arguments (the default
#                       skips CUDA-graph capture to keep three engine start-ups short; set it
#                       to '{}' for the paper's configuration)
#   VLLM_BATCH_INVARIANT=1  vLLM's batch-invariant kernels: greedy outputs must then agree
#                       across arms, and a mismatch fails the check
# Greedy outputs are compared across arms and reported. Without batch invariance vLLM
# does not promise equal bf16 outputs under different chunkings, so a mismatch alone
# does not fail this timing check; lost or unaccounted requests do.
# Exits non-zero, with the reason, when something is missing or the run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-${MODEL:-}}
PY=${PY:-python}
PROFILE=${PROFILE:-a100-paper}
REQUESTS=${REQUESTS:-12}
WARMUP=${WARMUP:-1}
SEED=${SEED:-801}
RATE=${RATE:-1.0}
SCALE=${SCALE:-1.0}
OUT=${OUT:-runs/gpu-check}
export DLFP_VLLM_ENGINE_ARGS=${DLFP_VLLM_ENGINE_ARGS:-'{"enforce_eager": true}'}

say() { printf '[gpu-check] %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }
[ -n "$MODEL" ] || fail "usage: $0 MODEL (a local Hugging Face folder, or a hub name if this machine reaches the hub)"

command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this check needs an NVIDIA GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || fail "nvidia-smi failed"
"$PY" - <<'PYCHECK' || fail "install dlfp, vllm==0.32.0, nvidia-ml-py and a CUDA build of torch into $PY first"
import sys
from dlfp.backends.vllm.version import check_vllm_version
check_vllm_version()
import pynvml
import torch
from dlfp.backends.vllm.gpu import check_cuda_driver
pynvml.nvmlInit()
warning = check_cuda_driver(pynvml, torch.version.cuda)  # raises when the driver cannot run this torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda})" + (f"; {warning}" if warning else ""), file=sys.stderr)
PYCHECK
if [ -d "$MODEL" ]; then
  [ -f "$MODEL/config.json" ] || fail "$MODEL has no config.json: pass a model folder"
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}  # a local folder needs no hub: never wait on one
else
  say "$MODEL is not a folder: it comes from the Hugging Face cache or hub (HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-unset})"
fi

say "model $MODEL, profile $PROFILE, $REQUESTS requests (+$WARMUP warmup), seed $SEED, rate $RATE/s"
start=$(date +%s)
# The bench harness refuses to start if unrelated processes hold the GPU.
rc=0
timeout 470 "$PY" -m dlfp.cli bench --backend vllm --model "$MODEL" --profile "$PROFILE" \
  --workload agent --rate "$RATE" --requests "$REQUESTS" --warmup "$WARMUP" --scale "$SCALE" \
  --seeds "$SEED" --policies unbounded,dlfp-cadence,dlfp --probe-period-s 0 --out "$OUT" || rc=$?
[ -f "$OUT/paired.json" ] || fail "the bench did not finish (exit $rc); see above"
# `dlfp bench` exits 1 on any greedy mismatch; here token accounting decides (and
# agreement too when batch invariance is on).
"$PY" -m dlfp.backends.vllm.agreement "$OUT/paired.json" || fail "check failed (bench exit $rc); results under $OUT"
say "done in $(( $(date +%s) - start )) s; results under $OUT"
