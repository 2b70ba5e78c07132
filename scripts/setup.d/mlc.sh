#!/usr/bin/env bash
# The mlc backend's step mode: apache-tvm (a close stand-in for MLC-LLM's own TVM build)
# compiles the tiny MLC-named test model and runs it on the CPU. MLC-LLM itself has no
# PyPI package (engine mode installs it from https://mlc.ai/wheels), so it is not installed here.
# Env: VENV, PY (set by scripts/setup.sh --all). Idempotent; a rerun takes about a second.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-${VENV:-.venv}/bin/python}
if "$PY" - <<'PYCHECK' 2>/dev/null; then
import importlib.metadata as m, sys
ok = m.version("apache-tvm").startswith("0.27.") and m.version("jinja2")
sys.exit(0 if ok else 1)
PYCHECK
  echo "[setup mlc] apache-tvm 0.27 already installed" >&2
else
  echo "[setup mlc] installing apache-tvm 0.27 (about a minute)" >&2
  "$PY" -m pip install --quiet --disable-pip-version-check "apache-tvm==0.27.*" "jinja2>=3.1"
fi
# Real models (`python -m dlfp.backends.mlc.build --gguf`): the GGUF reader and the tokenizer rebuild.
"$PY" -c 'import gguf, transformers, tokenizers' 2>/dev/null \
  || "$PY" -m pip install --quiet --disable-pip-version-check "gguf>=0.10" "transformers>=4.46" "tokenizers>=0.20"
# The tiny model is compiled by gcc through TVM's export_library: check a C compiler is there.
command -v "${CXX:-g++}" >/dev/null || command -v cc >/dev/null \
  || { echo "[setup mlc] no C/C++ compiler found: apt-get install g++ (TVM links compiled models with it)" >&2; exit 1; }
