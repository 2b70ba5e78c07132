"""Can this python run the torch GPU check? One line on stderr; exit status 1 and the reason if not.

    python3 scripts/run_from_checkout.py dlfp.backends.torch.preflight cuda|cpu

Imports nothing of dlfp beyond this package, so a missing module is named, not
shown as a traceback from deep inside the check.
"""
from __future__ import annotations

import sys


def preflight(device: str) -> str:
    """The torch and device line the log starts with; raises SystemExit with the reason it cannot run."""
    missing = []
    for mod in ("numpy", "torch"):
        try:
            __import__(mod)
        except ImportError as exc:
            missing.append(f"{mod} ({exc})")
    if missing:
        raise SystemExit(f"missing modules: {', '.join(missing)}")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda})")
    import dlfp.backends.torch.gpu_check  # noqa: F401  (the checkout imports with what this python has)

    line = f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}"
    if device == "cuda":
        line += f", built for CUDA {torch.version.cuda}"
        try:  # the driver's CUDA, where nvidia-ml-py is installed (a mismatch would have failed above)
            import pynvml

            pynvml.nvmlInit()
            v = pynvml.nvmlSystemGetCudaDriverVersion()
            line += f", driver supports CUDA {v // 1000}.{v % 1000 // 10}"
        except Exception as exc:  # noqa: BLE001 - informational only
            line += f" (driver CUDA version unknown: {exc})"
    return line


if __name__ == "__main__":
    print(preflight(sys.argv[1] if len(sys.argv) > 1 else "cpu"), file=sys.stderr)
