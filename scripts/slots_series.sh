#!/usr/bin/env bash
# Conversations beside documents (multi-turn-ingest), in one sitting on a quiet machine:
#   inprocess: unbounded and dlfp in process, on SEEDS;
#   baseline:  a baseline build's dlfp in process on BASE_SEEDS (BASE_DLFP: the `dlfp` of
#              another checkout's venv, e.g. a git worktree of an older commit set up with
#              DLFP_VENV=<worktree>/.venv bash <worktree>/scripts/setup.sh, plus
#              pip install -e '<worktree>[server]' for the serve step);
#   serve:     through `dlfp serve` (unbounded, dlfp, and the baseline's dlfp serve as a
#              third endpoint when BASE_DLFP is set), one `dlfp bench --endpoint` over them.
# Each into runs/<today>-<name>/; output and wall times go to runs/slots_series.log.
#
#   BASE_DLFP=/tmp/main-old/.venv/bin/dlfp bash scripts/slots_series.sh
#   STEPS="serve" BASE_DLFP=... bash scripts/slots_series.sh      # some of: inprocess baseline serve
set -uo pipefail
cd "$(dirname "$0")/.."
D=${DLFP:-.venv/bin/dlfp}
SEEDS=${SEEDS:-801 802 803 812 814 815 816}
BASE_SEEDS=${BASE_SEEDS:-801 802 803}
BASE_DLFP=${BASE_DLFP:-}
BASE_PORT=${BASE_PORT:-8204}
STEPS=" ${STEPS:-inprocess baseline serve} "
R=runs/${DATE:-$(date -u +%F)}
LOG=${LOG:-runs/slots_series.log}
mkdir -p runs

step() {
  echo "=== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"
  SECONDS=0
  "$@" >>"$LOG" 2>&1
  echo "    rc $?, took $SECONDS s" | tee -a "$LOG"
}
want() { [[ "$STEPS" == *" $1 "* ]]; }

if want inprocess; then
  # shellcheck disable=SC2086
  step "$D" bench --workload multi-turn-ingest --policies unbounded,dlfp --seeds $SEEDS --out "$R-slots"
fi
if want baseline && [ -n "$BASE_DLFP" ]; then
  # shellcheck disable=SC2086
  step "$BASE_DLFP" bench --workload multi-turn-ingest --policies dlfp --seeds $BASE_SEEDS --out "$R-slots-baseline"
fi
if want serve; then
  EXTRA=""
  if [ -n "$BASE_DLFP" ]; then
    MODEL=$(.venv/bin/python -c 'from dlfp.models import default_model_path; print(default_model_path())')
    THREADS=$(.venv/bin/python -c 'from dlfp.protocol import physical_cores; print(physical_cores())')
    "$BASE_DLFP" serve --model "$MODEL" --threads "$THREADS" --policy dlfp --port "$BASE_PORT" \
      >"runs/slots-baseline-serve.log" 2>&1 &
    BASE_PID=$!
    trap 'kill $BASE_PID 2>/dev/null' EXIT
    for _ in $(seq 120); do curl -sf "http://127.0.0.1:$BASE_PORT/v1/models" >/dev/null && break; sleep 1; done
    EXTRA="--endpoint baseline-dlfp=http://127.0.0.1:$BASE_PORT/v1"
  fi
  step env LLAMA_SERVER=0 WORKLOAD=multi-turn-ingest SEEDS="$SEEDS" OUT="$R-slots-serve" BENCH_ARGS="$EXTRA" \
    bash scripts/llama_server_bench.sh
fi
