set -u
D=runs/2026-12-06-step-gap
S="1234 1235 1236"
run() { # dir out args...
  local dir=$1 out=$2; shift 2
  echo "=== $(date -u +%T) $dir -> $out" >> /tmp/pr/gapab.log
  (cd $dir && nice -n -15 .venv/bin/python -m dlfp.cli bench "$@" --policies dlfp --seeds $S --out $dir/$out) >> /tmp/pr/gapab.log 2>&1
  echo "    rc $?" >> /tmp/pr/gapab.log
}
run /tmp/law $D-t50-base --workload laptop --itl-target-ms 50
run /tmp/new $D-t50 --workload laptop --itl-target-ms 50
run /tmp/new $D-t100 --workload laptop
run /tmp/law $D-t100-base --workload laptop
