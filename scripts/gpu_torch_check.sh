#!/usr/bin/env bash
# The torch backend on one GPU: Qwen3-8B, then Qwen3-0.6B, architectures with random bf16
# weights (bundled configs, like vLLM's load_format=dummy), the paper's Agent workload
# (16,384 in / 256 out; REQUESTS=12 at RATE=1.0/s), async then sync mode, arms unbounded,
# dlfp-cadence (the paper's law fed the scheduler-call interval), dlfp-paper (the same law
# fed completed step time) and dlfp, one seed. Prints each arm's time estimate before it
# runs and leaves out an arm that cannot finish inside LIMIT_S. Six files under $OUT
# (config.json, trials.jsonl, table.md, models.json, traces.tar.gz, run.log), the first
# four rewritten after every arm. Exit 1, with the reasons, when an arm completes fewer
# requests than it submitted, a greedy-token check fails or an arm is left out.
# Needs only python with torch (CUDA) and numpy: nothing installed, nothing downloaded;
# dlfp runs from this checkout (scripts/run_from_checkout.py), whatever the working folder.
#   bash scripts/gpu_torch_check.sh          # an NVIDIA GPU, at most about 9 minutes (docs/gpu.md)
#   bash scripts/gpu_torch_check.sh --tiny   # CPU, the tiny config in fp32 (CI; a minute or two)
# Environment (optional): PY=python3 OUT=runs/gpu-torch-check MODELS=qwen3-8b,qwen3-0.6b
#   MODES=async,sync ARMS=unbounded,dlfp-cadence,dlfp-paper,dlfp REQUESTS=12 RATE=1.0 SCALE=1.0
#   SEED=801 TARGET_MS=auto (decode step + 30% of the way to a full-budget step, both timed at
#   the workload's positions) LIMIT_S=500 (the measurement's own limit; a hard stop 45 s later)
set -uo pipefail  # every failure inside check() is handled where it happens
cd "$(dirname "$0")/.."
TINY=0
for arg in "$@"; do
  case "$arg" in
    --tiny) TINY=1 ;;
    *) echo "usage: $0 [--tiny]" >&2; exit 2 ;;
  esac
done
PY=${PY:-python3}
OUT=${OUT:-runs/gpu-torch-check}
LIMIT_S=${LIMIT_S:-500}
export PYTHONUNBUFFERED=1
RUN=("$PY" scripts/run_from_checkout.py)  # imports this checkout's dlfp first, whatever sys.path holds
mkdir -p "$OUT"

check() {
  say() { printf '[gpu-torch-check] %s\n' "$*"; }
  if [ "$TINY" = 1 ]; then
    MODELS=${MODELS:-tiny} DEVICE=cpu DTYPE=float32 PROFILE=backends/torch/profiles/cpu-tiny-agent.toml
    REQUESTS=${REQUESTS:-12} RATE=${RATE:-4.0} SCALE=${SCALE:-0.1} THREADS=${THREADS:-1}
  else
    MODELS=${MODELS:-qwen3-8b,qwen3-0.6b} DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16}
    PROFILE=${PROFILE:-backends/torch/profiles/h200-agent.toml}
    REQUESTS=${REQUESTS:-12} RATE=${RATE:-1.0} SCALE=${SCALE:-1.0} THREADS=${THREADS:-}
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    fi
  fi
  if ! "${RUN[@]}" dlfp.backends.torch.preflight "$DEVICE"; then
    say "python ($PY) cannot run this check (see above)"
    return 1
  fi
  say "models $MODELS, modes ${MODES:-async,sync}, $REQUESTS requests at $RATE/s (scale $SCALE), seed ${SEED:-801}," \
      "limit ${LIMIT_S} s, out $OUT"
  local start=$SECONDS rc=0
  timeout $((LIMIT_S + 45)) "${RUN[@]}" dlfp.backends.torch.gpu_check --models "$MODELS" \
    --modes "${MODES:-async,sync}" --arms "${ARMS:-unbounded,dlfp-cadence,dlfp-paper,dlfp}" --profile "$PROFILE" \
    --device "$DEVICE" --dtype "$DTYPE" ${THREADS:+--threads "$THREADS"} --seed "${SEED:-801}" \
    --requests "$REQUESTS" --rate "$RATE" --scale "$SCALE" --target-ms "${TARGET_MS:-auto}" \
    --limit-s "$LIMIT_S" --out "$OUT" || rc=$?
  if [ "$rc" != 0 ]; then
    if [ "$rc" = 124 ] && [ -s "$OUT/table.md" ]; then  # the hard stop: the table as of the last arm
      say "stopped at the hard limit; the arms measured so far:"
      cat "$OUT/table.md"
    fi
    say "gpu check failed (exit $rc) after $((SECONDS - start)) s; results under $OUT"
    return 1
  fi
  say "done in $((SECONDS - start)) s; results under $OUT"
}

rc=0
check 2>&1 | tee "$OUT/run.log" || rc=$?  # pipefail: check's own status
exit "$rc"
