#!/usr/bin/env bash
# Side by side with llama.cpp's own server: build `llama-server` from the llama.cpp sources
# vendored in the llama-cpp-python release this project pins (same kernels, same build flags
# where they apply), start it and `dlfp serve` (unbounded, dlfp) on the same model, threads
# and slots, and run ONE `dlfp bench --endpoint` over the three, same workload, same seeds.
# A measurement tool, not a dependency: no test needs it.
#
#   bash scripts/llama_server_bench.sh --build-only      # build (cached) and print the binary's path
#   bash scripts/llama_server_bench.sh                    # build if needed, start three servers, bench
#
# Environment (all optional):
#   PY=.venv/bin/python   the interpreter with dlfp[server] installed
#   MODEL=<default GGUF>  WORKLOAD=multi-turn-ingest  SEEDS="801 802 803"  THREADS=<physical cores>
#   SLOTS=4 CTX_PER_SLOT=2048 (the cpu-laptop profile's)  OUT=runs/llama-server-side-by-side
#   CACHE_PROMPT=1 (0: every request sends cache_prompt=false)  BENCH_ARGS="..." (extra dlfp bench options)
#   PORTS="8201 8202 8203"  JOBS=<nproc>  DLFP_LLAMA_SERVER_CACHE=~/.cache/dlfp/llama-server
#   LLAMA_SERVER=0 (only the `dlfp serve` arms: nothing built, no llama-server arm)
#   LS_ARGS="-b 8 -ub 8" (extra llama-server options, e.g. the small batch a user tunes for smooth
#   chat; the arm is then named llama-server-b8 after its -b)
#   LS_VARIANTS="; -b 8 -ub 8" (several llama-server arms in the one bench, their option sets
#   split at ";", an empty one the server's defaults; the first on the first of PORTS, the
#   others on the ports after its last; the default: LS_ARGS alone)
#   DLFP_POLICIES="unbounded dlfp" (the `dlfp serve` arms, one server each: the first on the
#   second of PORTS, the second on the third, any others from the third + 18; an arm is named
#   after its policy with ":" and "=" as "-", e.g. dlfp:contention_window_ms=40 ->
#   dlfp-contention_window_ms-40)
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_VERSION=0.3.36  # scripts/setup.sh pins the same release
PY=${PY:-.venv/bin/python}
DLFP=${DLFP:-$(dirname "$PY")/dlfp}
WORKLOAD=${WORKLOAD:-multi-turn-ingest}
SEEDS=${SEEDS:-801 802 803}
SLOTS=${SLOTS:-4}
CTX_PER_SLOT=${CTX_PER_SLOT:-2048}
OUT=${OUT:-runs/llama-server-side-by-side}
CACHE_PROMPT=${CACHE_PROMPT:-1}
read -r P_LS P_UNB P_DLFP <<<"${PORTS:-8201 8202 8203}"
JOBS=${JOBS:-$(nproc)}
BUILD_ONLY=0
LLAMA_SERVER=${LLAMA_SERVER:-1}
for arg in "$@"; do
  case "$arg" in
    --build-only) BUILD_ONLY=1 ;;
    *) echo "llama_server_bench.sh: unknown option $arg (use --build-only)" >&2; exit 2 ;;
  esac
done

say() { printf '[llama-server-bench] %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

# The build flags of scripts/setup.sh where they apply (GGML_LLAMAFILE=OFF: the same matmul
# kernels for every batch size), plus what a server build offline needs: no HTTPS, no web UI
# (neither built with npm nor downloaded), a static binary.
CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_LLAMAFILE=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
key=$( { grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; echo "${CMAKE_FLAGS[*]}"; } | sha1sum | cut -c1-12)
CACHE=${DLFP_LLAMA_SERVER_CACHE:-$HOME/.cache/dlfp/llama-server}/$LLAMA_CPP_VERSION-$(uname -m)-$key
BIN=$CACHE/llama-server

build() {
  command -v cmake >/dev/null || fail "cmake is missing (apt-get install cmake)"
  command -v ninja >/dev/null || fail "ninja is missing (apt-get install ninja-build)"
  mkdir -p "$CACHE/src"
  if [ ! -d "$CACHE/src/llama_cpp_python-$LLAMA_CPP_VERSION" ]; then
    say "fetching the llama-cpp-python $LLAMA_CPP_VERSION sdist (its vendored llama.cpp is what we build)"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
      -d "$CACHE/src" "llama-cpp-python==$LLAMA_CPP_VERSION"
    tar -xzf "$CACHE/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" -C "$CACHE/src"
  fi
  local src=$CACHE/src/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp
  say "building llama-server in $CACHE/build (~10+ min on 2 cores; cached afterwards)"
  cmake -S "$src" -B "$CACHE/build" "${CMAKE_FLAGS[@]}" >"$CACHE/cmake.log" 2>&1 \
    || { tail -20 "$CACHE/cmake.log"; fail "cmake configure failed (log: $CACHE/cmake.log)"; }
  ninja -C "$CACHE/build" -j "$JOBS" llama-server >"$CACHE/ninja.log" 2>&1 \
    || { tail -20 "$CACHE/ninja.log"; fail "build failed (log: $CACHE/ninja.log)"; }
  cp "$CACHE/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"  # only a finished build is cached
}

if [ "$LLAMA_SERVER" = 1 ] || [ "$BUILD_ONLY" = 1 ]; then
  [ -x "$BIN" ] || build
  say "llama-server: $BIN"
  [ "$BUILD_ONLY" = 1 ] && { echo "$BIN"; exit 0; }
fi

# `dlfp serve` needs the server extra: say so now, not after llama-server has started.
"$PY" -c 'import fastapi, uvicorn' 2>/dev/null \
  || fail "dlfp serve needs the server extra: $(dirname "$PY")/pip install -e '.[server]'"
MODEL=${MODEL:-$("$PY" -c 'from dlfp.models import default_model_path; print(default_model_path())')}
THREADS=${THREADS:-$("$PY" -c 'from dlfp.protocol import physical_cores; print(physical_cores())')}
mkdir -p "$OUT"
PIDS=()
STATE=$(mktemp -d)  # the servers' batch stores: not a result, so not under $OUT
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$STATE"
}
trap cleanup EXIT

# --no-repack: the AMX weight repacking crash the backend avoids (use_extra_bufts off);
# -fa off: the backend's attention kernels; -np/-c: the cpu-laptop profile's 4 slots of 2048
# positions (non-unified KV, as dlfp's default); batch sizes stay the server's defaults
# (n_batch 2048, n_ubatch 512): that is what a user runs.
ENDPOINTS=()
LS_PORTS=()
if [ "$LLAMA_SERVER" = 1 ]; then
  IFS=';' read -r -a LS_SETS <<<"${LS_VARIANTS-${LS_ARGS:-}}"
  [ "${#LS_SETS[@]}" -gt 0 ] || LS_SETS=("")
  for i in "${!LS_SETS[@]}"; do
    opts=${LS_SETS[$i]} port=$((i ? P_DLFP + i : P_LS)) name=llama-server
    [[ " $opts " =~ \ -b\ ([0-9]+) ]] && name=llama-server-b${BASH_REMATCH[1]}
    # shellcheck disable=SC2086
    "$BIN" -m "$MODEL" --host 127.0.0.1 --port "$port" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" \
      -c $((SLOTS * CTX_PER_SLOT)) --no-kv-unified --no-repack -fa off --no-webui $opts >"$OUT/$name.log" 2>&1 &
    PIDS+=($!)
    LS_PORTS+=("$port")
    ENDPOINTS+=(--endpoint "$name=http://127.0.0.1:$port/v1")
  done
fi
DLFP_PORTS=()
read -r -a SERVE_POLICIES <<<"${DLFP_POLICIES:-unbounded dlfp}"
for i in "${!SERVE_POLICIES[@]}"; do
  policy=${SERVE_POLICIES[$i]} name=${SERVE_POLICIES[$i]//[:=]/-}
  port=$((i == 0 ? P_UNB : i == 1 ? P_DLFP : P_DLFP + 16 + i))  # past the llama-server variants' ports
  "$DLFP" serve --model "$MODEL" --threads "$THREADS" --policy "$policy" --port "$port" --state-dir "$STATE/$name" \
    >"$OUT/dlfp-serve-$name.log" 2>&1 &
  PIDS+=($!)
  DLFP_PORTS+=("$port")
  ENDPOINTS+=(--endpoint "$name=http://127.0.0.1:$port/v1")
done
PORTS_UP=("${DLFP_PORTS[@]}" "${LS_PORTS[@]}")
for port in "${PORTS_UP[@]}"; do
  for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null || fail "no server answered on port $port (logs in $OUT)"
done

EXTRA=()
[ "$CACHE_PROMPT" = 0 ] && EXTRA+=(--no-cache-prompt)
say "dlfp bench --workload $WORKLOAD, seeds $SEEDS, $THREADS threads, $SLOTS slots -> $OUT"
# shellcheck disable=SC2086
"$DLFP" bench --workload "$WORKLOAD" --seeds $SEEDS --out "$OUT" --probe-period-s 0 \
  --tokenizer "$MODEL" --vocab-size "$("$PY" -c "
from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
print(LlamaCppBackend(LlamaCppConfig('$MODEL')).capabilities.vocab_size)")" \
  "${ENDPOINTS[@]}" "${EXTRA[@]}" ${BENCH_ARGS:-}
