#!/usr/bin/env bash
# The executorch backend: ExecuTorch 1.5.1 on CPU torch 2.13.0 (XNNPACK lowering and runtime).
#   VENV=.venv PY=.venv/bin/python bash scripts/setup.d/executorch.sh
# torch goes first and on its own so the local find-links' CPU build is taken (and
# ExecuTorch, which pins no torch, does not pull another one). Idempotent: a rerun
# that finds both in place takes about a second.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-${VENV:-.venv}/bin/python}
EXECUTORCH_VERSION=1.5.1
TORCH_VERSION=2.13.0
log() { printf '[setup executorch] %s\n' "$*" >&2; }
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)

have() {
  "$PY" - "$EXECUTORCH_VERSION" "$TORCH_VERSION" <<'PYCHECK' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("executorch") == sys.argv[1] and version("torch").split("+")[0] == sys.argv[2] else 1)
PYCHECK
}

# Real models (`export-executorch --gguf`): the GGUF reader and the tokenizer rebuild. No torch pulled.
GGUF_DEPS=("gguf>=0.10" "transformers>=4.46" "tokenizers>=0.20" "jinja2>=3.1")
"$PY" -c 'import gguf, transformers, tokenizers, jinja2' 2>/dev/null || { log "installing ${GGUF_DEPS[*]}"; "${PIP[@]}" "${GGUF_DEPS[@]}"; }

if have; then
  log "executorch $EXECUTORCH_VERSION with torch $TORCH_VERSION already installed"
  exit 0
fi
log "installing torch $TORCH_VERSION, then executorch $EXECUTORCH_VERSION (a few minutes)"
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" "executorch==$EXECUTORCH_VERSION" "torch==$TORCH_VERSION"
have || { log "executorch install incomplete (torch changed?)"; exit 1; }
log "executorch $EXECUTORCH_VERSION ready"
