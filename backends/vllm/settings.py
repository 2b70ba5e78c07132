"""The plug-in's parameters: vLLM's `--additional-config`, then environment, then the profile.

vLLM constructs the scheduler itself, so parameters cannot be passed to it. They are
read, in this order of precedence, from:

1. the `"dlfp"` object of vLLM's additional config, e.g.
   `vllm serve ... --additional-config '{"dlfp": {"policy": "dlfp", "target_ms": 80}}'`;
2. environment variables `DLFP_POLICY`, `DLFP_PROFILE`, `DLFP_TARGET_MS`,
   `DLFP_INITIAL`, `DLFP_MINIMUM`, `DLFP_MAXIMUM`, `DLFP_QUANTUM`, `DLFP_STEP_TRACE`
   (inherited by vLLM's engine-core process);
3. the device profile (default `a100-paper`, the paper's operating point).

`policy` is one of dlfp's policies: `dlfp` (completion-timed, the default),
`dlfp-cadence` (the paper's scheduler-call interval), `fixed:N`, `unbounded`.
`step_trace` names a JSONL file that receives one line per completed step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from dlfp.controller import DLFPParams, PrefillPolicy, parse_policy
from dlfp.devices.profiles import load_profile

CONFIG_KEY = "dlfp"
DEFAULT_PROFILE = "a100-paper"
_INT_KEYS = ("initial", "minimum", "maximum", "quantum")
KEYS = ("policy", "profile", "target_ms", *_INT_KEYS, "step_trace")


@dataclass(frozen=True)
class PluginSettings:
    policy: str
    params: DLFPParams
    step_trace: str | None = None

    def make_policy(self) -> PrefillPolicy:
        return parse_policy(self.policy, self.params)

    def as_config(self) -> dict:
        """The `{"dlfp": {...}}` additional-config object that reproduces these settings."""
        p = self.params
        body = {
            "policy": self.policy,
            "target_ms": p.target_s * 1e3,
            "initial": p.initial,
            "minimum": p.minimum,
            "maximum": p.maximum,
            "quantum": p.quantum,
        }
        if self.step_trace:
            body["step_trace"] = self.step_trace
        return {CONFIG_KEY: body}


def settings_from(additional_config: Mapping | None, environ: Mapping[str, str] = os.environ) -> PluginSettings:
    """Merge the sources above; raise ValueError naming the bad key or value."""
    given = dict((additional_config or {}).get(CONFIG_KEY) or {})
    unknown = set(given) - set(KEYS)
    if unknown:
        raise ValueError(f"unknown dlfp plug-in keys {sorted(unknown)}; known: {', '.join(KEYS)}")
    for key in KEYS:
        env = environ.get(f"DLFP_{key.upper()}")
        if key not in given and env not in (None, ""):
            given[key] = env
    profile = load_profile(str(given.get("profile", DEFAULT_PROFILE)))
    try:
        target_ms = float(given.get("target_ms", profile.itl_target_ms))
        ints = {k: int(given.get(k, getattr(profile, k))) for k in _INT_KEYS}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"dlfp plug-in: {exc}") from None
    params = DLFPParams(target_ms / 1e3, **ints)
    settings = PluginSettings(str(given.get("policy", "dlfp")), params, given.get("step_trace") or None)
    settings.make_policy()  # validates the policy name now, at engine start-up
    return settings
