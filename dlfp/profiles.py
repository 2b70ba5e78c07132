"""Device profiles: the controller's defaults per device class, kept out of code."""
from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass, fields

from dlfp.protocol import Limits
from dlfp.controller import params_from_table
from dlfp.tail import TailParams
from dlfp.devices.profile_files import bundled_profiles, profile_text


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    preemption_budget_ms: float  # 0: no budget
    preemption_initial: int
    # Limits, in the names every adapter uses (dlfp.protocol.Limits).
    max_sequences: int
    context_per_sequence: int
    max_batch_tokens: int
    # The `[controller]` table: target_ms and the controller's parameters by their names
    # (dlfp.tail.TailParams); read by one function, dlfp.controller.params_from_table.
    controller: dict
    # Thermal governor (dlfp.devices.governor): hold background prefill back above this
    # temperature, or on battery below this charge (0: never for the battery).
    thermal_limit_c: float = 90.0
    battery_min_percent: float = 0.0
    # A foreground request's time-to-first-token goal where it names none: its prompt's deadline.
    ttft_goal_ms: float = 5000.0
    # The contention watch (dlfp/contention.py): a guarded step is cut once some task has waited
    # for a core this share of one core's time over the latest window (the kernel's reading over
    # a step's N threads: this share / N; docs/controller.md says why these values).
    contention_window_ms: float = 20.0
    contention_core_share: float = 0.7
    # The preemption budget where the backend cuts a step at a foreground arrival
    # (Capabilities.cut_steps): the arrival no longer waits for the step, so the budget bounds
    # only the work it throws away (0: preemption_budget_ms on every backend).
    cut_budget_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (self.contention_window_ms > 0 and 0 < self.contention_core_share <= 1):
            raise ValueError(f"need contention_window_ms > 0 and 0 < contention_core_share <= 1; got "
                             f"{self.contention_window_ms}, {self.contention_core_share}")
        if not (self.preemption_budget_ms >= 0 and self.cut_budget_ms >= 0):
            raise ValueError(f"need preemption_budget_ms >= 0 and cut_budget_ms >= 0 (0: none); got "
                             f"{self.preemption_budget_ms}, {self.cut_budget_ms}")

    def controller_params(self, itl_target_ms: float | None = None) -> TailParams:
        """The controller's parameters; `itl_target_ms` overrides the profile's goal."""
        return params_from_table(self.controller, itl_target_ms)

    @property
    def itl_target_ms(self) -> float:
        """The foreground's ITL goal the profile sets."""
        return float(self.controller["target_ms"])

    @property
    def limits(self) -> Limits:
        return Limits(self.max_sequences, self.context_per_sequence, self.max_batch_tokens)

    def budget_s(self, cuts_steps: bool) -> float | None:
        """The preemption budget on a backend that does, or does not, cut a step at an arrival
        (None: no budget)."""
        if self.preemption_budget_ms <= 0:
            return None
        if cuts_steps and self.cut_budget_ms > 0:
            return self.cut_budget_ms / 1e3
        return self.preemption_budget_ms / 1e3


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
    profile = DeviceProfile(**data)
    try:
        profile.controller_params()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"profile {name_or_path!r}: [controller]: {exc}") from None
    return profile
