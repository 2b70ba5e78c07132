#!/usr/bin/env bash
# The torch backend on one GPU: Qwen3-0.6B and Qwen3-8B architectures with random bf16
# weights (bundled configs, like vLLM's load_format=dummy), the paper's Agent workload
# (16,384 in / 256 out; REQUESTS=12 at RATE=1.0/s, so an arm takes roughly 20-40 s), arms
# unbounded, dlfp-cadence (the paper's scheduler-call interval) and dlfp (completion),
# sync and async modes, one seed. Writes trials.jsonl, table.md, models.json and
# per-trial traces under $OUT and prints the paired table. Needs only python with torch
# (CUDA) and numpy: no install, no download, dlfp runs from this checkout.
#   bash scripts/gpu_torch_check.sh          # an NVIDIA GPU (H200: estimated 5-7 minutes; unmeasured)
#   bash scripts/gpu_torch_check.sh --tiny   # CPU, the tiny config in fp32 (CI; seconds)
# Environment (optional): PY=python3 OUT=runs/gpu-torch-check MODELS=qwen3-0.6b,qwen3-8b
#   MODES=sync,async ARMS=unbounded,dlfp-cadence,dlfp REQUESTS=12 RATE=1.0 SCALE=1.0 SEED=801
#   TARGET_MS=auto (decode step + 30% of the way to a full-budget step) LIMIT_S=460
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
TINY=0
for arg in "$@"; do
  case "$arg" in
    --tiny) TINY=1 ;;
    *) echo "usage: $0 [--tiny]" >&2; exit 2 ;;
  esac
done
PY=${PY:-python3}
OUT=${OUT:-runs/gpu-torch-check}
say() { printf '[gpu-torch-check] %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

# dlfp from this checkout without installing it: a package folder of links (the
# repository keeps dlfp.backends, dlfp.devices and dlfp.workloads in top-level folders).
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir "$SHIM/dlfp"
for f in "$REPO"/dlfp/*; do ln -s "$f" "$SHIM/dlfp/"; done
ln -s "$REPO/backends" "$SHIM/dlfp/backends"
ln -s "$REPO/devices" "$SHIM/dlfp/devices"
ln -s "$REPO/workloads" "$SHIM/dlfp/workloads"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"

if [ "$TINY" = 1 ]; then
  MODELS=${MODELS:-tiny} DEVICE=cpu DTYPE=float32 PROFILE=backends/torch/profiles/cpu-tiny-agent.toml
  REQUESTS=${REQUESTS:-6} RATE=${RATE:-4.0} SCALE=${SCALE:-0.02} THREADS=${THREADS:-1}
else
  MODELS=${MODELS:-qwen3-0.6b,qwen3-8b} DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16}
  PROFILE=${PROFILE:-backends/torch/profiles/h200-agent.toml}
  REQUESTS=${REQUESTS:-12} RATE=${RATE:-1.0} SCALE=${SCALE:-1.0} THREADS=${THREADS:-}
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
  fi
fi
"$PY" - "$DEVICE" <<'PYCHECK' || fail "python ($PY) cannot run this check (see above)"
import sys
missing = []
for mod in ("numpy", "torch"):
    try:
        __import__(mod)
    except ImportError:
        missing.append(mod)
if missing:
    sys.exit(f"missing modules: {', '.join(missing)}")
import torch
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda})")
import dlfp.backends.torch.gpu_check  # noqa: F401  (the shim works)
line = f"torch {torch.__version__}, device {torch.cuda.get_device_name() if sys.argv[1] == 'cuda' else 'cpu'}"
if sys.argv[1] == "cuda":
    line += f", built for CUDA {torch.version.cuda}"
    try:  # the driver's CUDA, where nvidia-ml-py is installed (a mismatch would have failed above)
        import pynvml
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetCudaDriverVersion()
        line += f", driver supports CUDA {v // 1000}.{v % 1000 // 10}"
    except Exception as exc:  # noqa: BLE001
        line += f" (driver CUDA version unknown: {exc})"
print(line, file=sys.stderr)
PYCHECK

mkdir -p "$OUT"
say "models $MODELS, modes ${MODES:-sync,async}, $REQUESTS requests at $RATE/s (scale $SCALE), seed ${SEED:-801}, out $OUT"
start=$(date +%s)
rc=0
timeout "${LIMIT_S:-460}" "$PY" -m dlfp.backends.torch.gpu_check --models "$MODELS" --modes "${MODES:-sync,async}" \
  --arms "${ARMS:-unbounded,dlfp-cadence,dlfp}" --profile "$PROFILE" --device "$DEVICE" --dtype "$DTYPE" \
  ${THREADS:+--threads "$THREADS"} \
  --seed "${SEED:-801}" --requests "$REQUESTS" --rate "$RATE" --scale "$SCALE" --target-ms "${TARGET_MS:-auto}" \
  --out "$OUT" || rc=$?
if [ "$rc" != 0 ]; then
  if [ -s "$OUT/trials.jsonl" ]; then  # cut short (time limit) or failed later: show what was measured
    say "stopped with exit $rc after $(( $(date +%s) - start )) s; the arms measured so far:"
    "$PY" -m dlfp.backends.torch.gpu_check --table-from "$OUT" || true
  fi
  fail "gpu check failed (exit $rc); results under $OUT"
fi
say "done in $(( $(date +%s) - start )) s; results under $OUT"
