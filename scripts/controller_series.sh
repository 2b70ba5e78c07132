#!/usr/bin/env bash
# The controller's side-by-side series: a baseline build's `dlfp` and this checkout's on the
# same seeds, workloads and targets, in one sitting on a quiet machine. Each (build,
# condition) is one `dlfp bench --policies dlfp` over SEEDS into runs/<today>-controller-<cond>
# (this checkout) and ...-<cond>-base (the baseline); the builds alternate which runs first.
# The baseline runs from BASE_DIR (e.g. a git worktree of main) with its own venv, so every
# package of it (dlfp, and dlfp.backends / .devices / .workloads, which an editable install
# maps to its own checkout) is the baseline's, and its provenance names its own commit.
#
#   git worktree add /tmp/main-old main && DLFP_VENV=/tmp/main-old/.venv bash /tmp/main-old/scripts/setup.sh
#   BASE_DIR=/tmp/main-old bash scripts/controller_series.sh
#   CONDS="t100 nn" BASE_DIR=... bash scripts/controller_series.sh
#
# WIDE=1 gives this checkout the arms the controller is judged against (the baseline runs its
# `dlfp` only): T = 100 the sweep fixed:2,4,8,16 (with unbounded), T = 50 fixed:1,2,4,8, the
# neighbour fixed:2. Unbounded does not depend on T: it runs once, at T = 100. ARMS sets this
# checkout's arms for every condition instead (ARMS="--policies dlfp,dlfp:turn_first=false").
set -uo pipefail
cd "$(dirname "$0")/.."
HERE=$(pwd)
PY=${PY:-$HERE/.venv/bin/python}
BASE_DIR=${BASE_DIR:?set BASE_DIR to the baseline checkout}
BASE_PY=${BASE_PY:-$BASE_DIR/.venv/bin/python}
[ -x "$BASE_PY" ] || { echo "no $BASE_PY: set up the baseline's own venv (see above)" >&2; exit 2; }
SEEDS=${SEEDS:-801 802 803 821 822 823}
CONDS=${CONDS:-t100 nn t50 li}
NICE=${NICE:--15}
R=$HERE/runs/${DATE:-$(date -u +%F)}-controller
LOG=${LOG:-$HERE/runs/controller_series.log}
mkdir -p runs

declare -A ARGS=(
  [t100]="--workload laptop"
  [t50]="--workload laptop --itl-target-ms 50"
  [nn]="--workload noisy-neighbour"
  [li]="--workload low-interference"
  [mt]="--workload multi-turn-ingest"
)

declare -A WIDE_ARMS=(
  [t100]="--sweep fixed:2,4,8,16"
  [t50]="--policies fixed:1,fixed:2,fixed:4,fixed:8,dlfp"
  [nn]="--policies fixed:2,dlfp"
)

DLFP_ONLY="--policies dlfp"

one() {  # python build-dir out cond [arms]
  local py=$1 dir=$2 out=$3 cond=$4 arms=${5:-$DLFP_ONLY}
  echo "=== $(date -u +%H:%M:%S) $dir $cond -> $out" | tee -a "$LOG"
  SECONDS=0
  # shellcheck disable=SC2086
  (cd "$dir" && nice -n "$NICE" "$py" -m dlfp.cli bench ${ARGS[$cond]} $arms \
      --seeds $SEEDS --out "$out") >>"$LOG" 2>&1
  echo "    rc $?, took $SECONDS s" | tee -a "$LOG"
}

i=0
for cond in $CONDS; do
  [ -n "${ARGS[$cond]:-}" ] || { echo "unknown condition $cond (one of ${!ARGS[*]})" >&2; exit 2; }
  arms=$DLFP_ONLY
  [ "${WIDE:-0}" = 1 ] && arms=${WIDE_ARMS[$cond]:-$arms}
  arms=${ARMS:-$arms}
  if (( i % 2 == 0 )); then
    one "$BASE_PY" "$BASE_DIR" "$R-$cond-base" "$cond"; one "$PY" "$HERE" "$R-$cond" "$cond" "$arms"
  else
    one "$PY" "$HERE" "$R-$cond" "$cond" "$arms"; one "$BASE_PY" "$BASE_DIR" "$R-$cond-base" "$cond"
  fi
  i=$((i + 1))
done
