#!/usr/bin/env bash
# Lean CPU install of vLLM for the scheduler plug-in's tests (run by setup.sh --all).
#   VENV=.venv PY=.venv/bin/python bash scripts/setup.d/vllm.sh
# The full `pip install vllm` pulls several GB of CUDA packages. The scheduler needs
# none of them: install vLLM without dependencies, CPU torch, and only the light
# packages its scheduler and config modules import, at the versions vLLM itself
# requires (read from its metadata). Idempotent: a rerun that finds everything in
# place takes about a second. A GPU machine uses `pip install vllm==$VLLM_VERSION`.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VENV:-.venv}
PY=${PY:-$VENV/bin/python}
# Keep in step with SUPPORTED_VLLM in backends/vllm/version.py.
VLLM_VERSION=0.32.0
# vLLM 0.32.0 pins torch 2.13.0; 0.33.0 pins 2.14.0, for which no CPU wheel is on hand.
TORCH_VERSION=2.13.0
# Found by importing the scheduler, ModelConfig over a tiny OPT config, and the
# plug-in, and adding what was missing until nothing was.
LIGHT="regex pydantic cbor2 pyzmq transformers aiohttp openai pybase64 cachetools
prometheus_client msgspec cloudpickle py-cpuinfo xgrammar fastapi partial-json-parser
llguidance einops openai-harmony uvloop"

log() { printf '[setup vllm] %s\n' "$*" >&2; }
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
# pip lists every GPU dependency of vLLM left out on purpose: drop those lines only.
pip_lean() {
  "${PIP[@]}" "$@" 2> >(grep -v -e "^vllm $VLLM_VERSION requires" -e "dependency resolver does not currently" >&2)
}
export VLLM_TARGET_DEVICE=cpu

have_all() {
  "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" $LIGHT <<'EOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
vllm_v, torch_v, *light = sys.argv[1:]
try:
    ok = version("vllm") == vllm_v and version("torch").split("+")[0] == torch_v
    ok = ok and all(version(name) for name in light)
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
EOF
}

if have_all; then
  log "vllm $VLLM_VERSION (lean CPU install) already in place"
  exit 0
fi

log "installing torch $TORCH_VERSION (CPU) and vllm $VLLM_VERSION without dependencies"
# torch first and on its own: the local find-links hold its CPU build.
"${PIP[@]}" "torch==$TORCH_VERSION"
pip_lean --no-deps "vllm==$VLLM_VERSION"

# The light dependencies, each with the version specifier vLLM's metadata gives it
# (extras and environment markers dropped: only x86-64/aarch64 Linux is targeted).
mapfile -t SPECS < <("$PY" - $LIGHT <<'EOF'
import re, sys
from importlib.metadata import requires
wanted = {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[1:]}
for line in requires("vllm") or []:
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?$", line)
    if not m or "extra ==" in (m.group(4) or ""):
        continue
    name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
    if name in wanted:
        print(name + m.group(3).strip())
        wanted.discard(name)
for name in sorted(wanted):  # not named by vLLM (pulled in indirectly): any version
    print(name)
EOF
)
log "installing ${#SPECS[@]} light dependencies"
pip_lean "${SPECS[@]}"
have_all || { log "lean vLLM install incomplete"; exit 1; }
log "vllm $VLLM_VERSION ready (CPU, scheduler only)"
