"""The one vLLM release the scheduler plug-in is written against.

The plug-in subclasses vLLM's scheduler and sets instance attributes that vLLM
documents as internal (`max_num_scheduled_tokens`, the order of `running`), so it
is checked against one release rather than trusted on any.
"""
from __future__ import annotations

import os

SUPPORTED_VLLM = "0.32.0"  # keep in step with scripts/setup.d/vllm.sh
# Set to 1 to run on another release at your own risk (the check then only warns).
OVERRIDE_ENV = "DLFP_VLLM_ANY_VERSION"


def check_vllm_version(found: str | None = None) -> None:
    """Raise RuntimeError unless the installed vLLM is the supported release."""
    if found is None:
        import vllm

        found = vllm.__version__
    if found == SUPPORTED_VLLM or os.environ.get(OVERRIDE_ENV) == "1":
        return
    raise RuntimeError(
        f"dlfp's vLLM scheduler plug-in supports vLLM {SUPPORTED_VLLM}, found {found}: "
        f"install vllm=={SUPPORTED_VLLM} (or set {OVERRIDE_ENV}=1 to try this release anyway)"
    )
