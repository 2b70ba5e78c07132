#!/usr/bin/env bash
# A reduced A100 reproduction on an NVIDIA machine with vLLM: fewer requests, one seed,
# the three policies (unbounded = stock vLLM, dlfp-cadence = the paper, dlfp = completion),
# end to end through `dlfp bench`, in under 8 minutes.
#   bash scripts/gpu_check.sh [MODEL]     # MODEL: a local folder (no hub needed) or a hub name
# Environment (all optional):
#   PY=python           the interpreter with dlfp, vllm==0.32.0 and nvidia-ml-py installed
#   PROFILE=a100-paper  device profile (the paper's parameters; h200 for an H200)
#   REQUESTS=12 WARMUP=1 SEED=801 RATE=1.0 SCALE=1.0 OUT=runs/gpu-check
#   DLFP_VLLM_ENGINE_ARGS='{"enforce_eager": true}'  extra vLLM engine arguments (the default
#                       skips CUDA-graph capture to keep three engine start-ups short; set it
#                       to '{}' for the paper's configuration)
# Exits non-zero, with the reason, when something is missing or the run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-${MODEL:-Qwen/Qwen3-0.6B}}
PY=${PY:-python}
PROFILE=${PROFILE:-a100-paper}
REQUESTS=${REQUESTS:-12}
WARMUP=${WARMUP:-1}
SEED=${SEED:-801}
RATE=${RATE:-1.0}
SCALE=${SCALE:-1.0}
OUT=${OUT:-runs/gpu-check}
export DLFP_VLLM_ENGINE_ARGS=${DLFP_VLLM_ENGINE_ARGS:-'{"enforce_eager": true}'}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}  # the GPU box reaches no hub: fail fast, not on a timeout

say() { printf '[gpu-check] %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

command -v nvidia-smi >/dev/null || fail "no nvidia-smi: this check needs an NVIDIA GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || fail "nvidia-smi failed"
"$PY" - <<'EOF' || fail "install dlfp, vllm==0.32.0 and nvidia-ml-py into $PY first"
from dlfp.backends.vllm.version import check_vllm_version
check_vllm_version()
import pynvml  # noqa: F401
EOF
if [ -d "$MODEL" ]; then
  [ -f "$MODEL/config.json" ] || fail "$MODEL has no config.json: pass a model folder"
else
  say "using $MODEL from the local Hugging Face cache (offline); pass a local folder if it is not there"
fi

say "model $MODEL, profile $PROFILE, $REQUESTS requests (+$WARMUP warmup), seed $SEED, rate $RATE/s"
start=$(date +%s)
# The bench harness refuses to start if unrelated processes hold the GPU.
timeout 470 "$PY" -m dlfp.cli bench --backend vllm --model "$MODEL" --profile "$PROFILE" \
  --workload agent --rate "$RATE" --requests "$REQUESTS" --warmup "$WARMUP" --scale "$SCALE" \
  --seeds "$SEED" --policies unbounded,dlfp-cadence,dlfp --probe-period-s 0 --out "$OUT"
say "done in $(( $(date +%s) - start )) s; results under $OUT"
