#!/usr/bin/env bash
# The measurements behind the docs' tables in one series, in priority order, on a quiet
# machine, each into runs/<today>-<name>/ (the kept-run layout: dlfp/runs.py); then
# `dlfp report --docs` redraws the tables once their markers name the new folders.
# Each command's output and wall time go to runs/bench_series.log; a failed command is
# logged and the series goes on. Run it when nothing else runs (a 2-core machine's
# llama.cpp threads lose most of a step to any other runnable process: the thread
# governor would then run dlfp's steps on one thread, and the figures would say so).
#
#   bash scripts/bench_series.sh              # all of them (hours on 2 cores)
#   ONLY="laptop nn" bash scripts/bench_series.sh
set -uo pipefail
cd "$(dirname "$0")/.."
D=${DLFP:-.venv/bin/dlfp}
LOG=${LOG:-runs/bench_series.log}
NICE=${NICE:--15}
R=runs/${DATE:-$(date -u +%F)}
mkdir -p runs

declare -A CMD=(
  [laptop]="$D laptop --out $R-laptop"
  [nn]="$D bench --workload noisy-neighbour --policies unbounded,fixed:2,fixed:4,fixed:8,dlfp --seeds 801 802 803 --out $R-noisy-neighbour-all"
  [nn-best]="$D bench --workload noisy-neighbour --policies fixed:2,dlfp --seeds 801 802 803 --out $R-noisy-neighbour"
  [t50]="$D bench --workload laptop --sweep fixed:1,2,4,8 --itl-target-ms 50 --seeds 801 802 803 --out $R-sweep-t50"
  [t100]="$D bench --workload laptop --sweep fixed:2,4,8,16 --seeds 801 802 803 --out $R-sweep-t100"
  [li]="$D bench --workload low-interference --seeds 801 802 803 --out $R-low-interference"
  [mti]="$D bench --workload multi-turn-ingest --policies dlfp --seeds 801 802 803 --out $R-multi-turn-ingest"
  [mti-cold]="$D bench --workload multi-turn-ingest --policies dlfp --seeds 801 802 803 --no-cache-prompt --out $R-multi-turn-ingest-cold"
  [ls-mt]="env WORKLOAD=multi-turn-ingest OUT=$R-llama-server-multi-turn bash scripts/llama_server_bench.sh"
  [ls-laptop]="env WORKLOAD=laptop OUT=$R-llama-server-laptop bash scripts/llama_server_bench.sh"
)
ORDER=${ONLY:-laptop nn nn-best t50 li mti mti-cold t100 ls-mt ls-laptop}

for key in $ORDER; do
  cmd=${CMD[$key]:-}
  [ -n "$cmd" ] || { echo "unknown step $key (one of ${!CMD[*]})" >&2; exit 2; }
  echo "=== $(date -u +%H:%M:%S) $cmd" | tee -a "$LOG"
  SECONDS=0
  nice -n "$NICE" $cmd >>"$LOG" 2>&1
  rc=$?
  echo "    rc $rc, took $SECONDS s" | tee -a "$LOG"
done
