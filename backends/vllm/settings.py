"""The plug-in's parameters: vLLM's `--additional-config`, then environment, then the profile.

vLLM constructs the scheduler itself, so parameters cannot be passed to it. They are
read, in this order of precedence, from:

1. the `"dlfp"` object of vLLM's additional config, e.g.
   `vllm serve ... --additional-config '{"dlfp": {"policy": "dlfp", "target_ms": 80}}'`;
2. environment variables `DLFP_POLICY`, `DLFP_PROFILE`, `DLFP_STEP_TRACE` and one per
   controller parameter (`DLFP_TARGET_MS`, `DLFP_INITIAL`, `DLFP_MINIMUM`, `DLFP_MAXIMUM`,
   `DLFP_QUANTUM`, `DLFP_MAX_GROWTH`, ...), inherited by vLLM's engine-core process;
3. the device profile (default `a100-paper`, the paper's operating point).

The controller parameters are every field of `TailParams`, serialised by
`controller.params_to_dict` / `params_from_dict`: the same path the owned-loop
engine's traces use, so a parameter cannot be dropped on the way to the engine core.
`policy` is one of dlfp's policies (`dlfp`, `dlfp-cadence`, `fixed:N`, `unbounded`).
`step_trace` names a JSONL file that receives one line per completed step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from dlfp.controller import parse_policy
from dlfp.policy import params_from_dict, params_to_dict, PrefillPolicy
from dlfp.tail import TailParams
from dlfp.profiles import load_profile

CONFIG_KEY = "dlfp"
DEFAULT_PROFILE = "a100-paper"
OWN_KEYS = ("policy", "profile", "step_trace")


@dataclass(frozen=True)
class PluginSettings:
    policy: str
    params: TailParams
    step_trace: str | None = None

    def make_policy(self) -> PrefillPolicy:
        return parse_policy(self.policy, self.params)

    def as_config(self) -> dict:
        """The `{"dlfp": {...}}` additional-config object that reproduces these settings."""
        body = {"policy": self.policy, **params_to_dict(self.params)}
        if self.step_trace:
            body["step_trace"] = self.step_trace
        return {CONFIG_KEY: body}


def settings_from(additional_config: Mapping | None, environ: Mapping[str, str] = os.environ) -> PluginSettings:
    """Merge the sources above; raise ValueError naming the bad key or value."""
    given = dict((additional_config or {}).get(CONFIG_KEY) or {})
    profile = load_profile(str(given.get("profile") or environ.get("DLFP_PROFILE") or DEFAULT_PROFILE))
    keys = (*OWN_KEYS, *params_to_dict(profile.controller_params()))
    unknown = set(given) - set(keys)
    if unknown:
        raise ValueError(f"unknown dlfp plug-in keys {sorted(unknown)}; known: {', '.join(keys)}")
    for key in keys:
        env = environ.get(f"DLFP_{key.upper()}")
        if key not in given and env not in (None, ""):
            given[key] = env
    param_values = {k: v for k, v in given.items() if k not in OWN_KEYS}
    try:
        params = params_from_dict(param_values, profile.controller_params())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"dlfp plug-in: {exc}") from None
    settings = PluginSettings(str(given.get("policy", "dlfp")), params, given.get("step_trace") or None)
    settings.make_policy()  # validates the policy name now, at engine start-up
    return settings
