"""Device profiles: the controller's defaults per device class, kept out of code."""
from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass, fields

from dlfp.protocol import Limits
from dlfp.controller import DLFPParams
from dlfp.devices.profile_files import bundled_profiles, profile_text


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    itl_target_ms: float
    initial: int
    minimum: int
    maximum: int
    quantum: int
    preemption_budget_ms: float  # 0: no budget
    preemption_initial: int
    # Limits, in the names every adapter uses (dlfp.protocol.Limits).
    max_sequences: int
    context_per_sequence: int
    max_batch_tokens: int
    # Thermal governor (dlfp.devices.governor): hold background prefill back above this
    # temperature, or on battery below this charge (0: never for the battery).
    thermal_limit_c: float = 90.0
    battery_min_percent: float = 0.0
    max_growth: float = 0.0  # largest per-step growth of the cap (0: unlimited, the paper's law)
    # The tail-aware controller (`dlfp`); defaults as DLFPParams', see dlfp/controller.py.
    quantile: float = 0.99
    window: int = 128
    forgetting: float = 0.9
    prior_spread: float = 1.5
    zero_cap: bool = False
    probe_every: int = 32

    def dlfp_params(self, itl_target_ms: float | None = None) -> DLFPParams:
        target = itl_target_ms if itl_target_ms is not None else self.itl_target_ms
        growth = self.max_growth if self.max_growth > 0 else None
        return DLFPParams(target / 1e3, self.initial, self.minimum, self.maximum, self.quantum, growth,
                          quantile=self.quantile, window=self.window, forgetting=self.forgetting,
                          prior_spread=self.prior_spread, zero_cap=self.zero_cap, probe_every=self.probe_every)

    @property
    def limits(self) -> Limits:
        return Limits(self.max_sequences, self.context_per_sequence, self.max_batch_tokens)

    @property
    def preemption_budget_s(self) -> float | None:
        return self.preemption_budget_ms / 1e3 if self.preemption_budget_ms > 0 else None


def available_profiles() -> list[str]:
    return bundled_profiles()


def load_profile(name_or_path: str) -> DeviceProfile:
    """A bundled profile by name (`cpu-laptop`) or a TOML file by path."""
    data = tomllib.loads(profile_text(name_or_path))
    known = {f.name for f in fields(DeviceProfile)}
    unknown = set(data) - known
    required = {f.name for f in fields(DeviceProfile) if f.default is MISSING}
    missing = required - set(data)
    if unknown or missing:
        raise ValueError(f"profile {name_or_path!r}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
    return DeviceProfile(**data)
