"""One place maps a policy's name to a policy: `unbounded`, `fixed:N`, `dlfp` (the
tail-aware controller, dlfp/tail.py), `dlfp-paper` and `dlfp-cadence` (the paper's law,
dlfp/paper.py, timed by completion or by its scheduler-call proxy); a device profile's
controller table to the parameters they take; and the preemption budget's policy.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Mapping

from dlfp.paper import PaperDLFP, PaperParams
from dlfp.policy import CADENCE, COMPLETION, FixedCap, PrefillPolicy, Unbounded
from dlfp.tail import TailDLFP, TailParams


def params_from_table(table: Mapping, itl_target_ms: float | None = None) -> TailParams:
    """A device profile's `[controller]` table (target_ms and TailParams' other field names)
    as parameters; `itl_target_ms` overrides the table's target. Every default is
    TailParams' own: a profile names only what differs."""
    values = dict(table)
    if itl_target_ms is not None:
        values["target_ms"] = itl_target_ms
    known = {f.name for f in fields(TailParams)} - {"target_s"} | {"target_ms"}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown controller parameter(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
    missing = {"target_ms", "initial", "minimum", "maximum"} - set(values)
    if missing:
        raise ValueError(f"the controller table lacks {sorted(missing)}")
    target_s = float(values.pop("target_ms")) / 1e3
    if values.get("max_growth") in (0, 0.0):
        values["max_growth"] = None  # 0: no limit, as TOML has no null
    return TailParams(target_s=target_s, **values)


POLICY_NAMES = ("unbounded", "fixed:N", "dlfp[:name=value...]", "dlfp-paper", "dlfp-cadence")


def with_overrides(params: TailParams, pairs: list[str]) -> TailParams:
    """`params` with `name=value` pairs applied (value `none`: None), read as a profile's
    controller table is (params_from_table: the same names, target_ms in ms)."""
    if not pairs:
        return params
    table = {f.name: getattr(params, f.name) for f in fields(TailParams) if f.name != "target_s"}
    table["target_ms"] = params.target_s * 1e3
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"dlfp parameter {pair!r}: name=value")
        table[name] = _typed(pair, text, table[name]) if name in table else text
    return params_from_table(table)


def _typed(pair: str, text: str, like: object) -> object:
    """`text` as a value of `like`'s type (a float where `like` is None)."""
    try:
        if text.lower() == "none":
            return None
        if isinstance(like, bool):
            return {"true": True, "false": False}[text.lower()]
        return int(text) if isinstance(like, int) else float(text)
    except (KeyError, ValueError):
        raise ValueError(f"dlfp parameter {pair!r}: {text!r} is not a {type(like).__name__}") from None


def parse_policy(spec: str, defaults: TailParams) -> PrefillPolicy:
    """`unbounded`, `fixed:N`, `dlfp`, `dlfp-paper`, `dlfp-cadence` -> a fresh policy.
    `dlfp:name=value[:name=value]` overrides the tail controller's parameters for one arm
    (`dlfp:quantile=0.995`, `dlfp:window=64:zero_cap=false`).

    The paper's law runs without a growth limit (equation (2) as published),
    whatever the profile sets for max_growth.
    """
    spec = spec.strip()
    if spec == "unbounded":
        return Unbounded()
    if spec.startswith("fixed:"):
        value = spec.split(":", 1)[1]
        if not value.isdigit():
            raise ValueError(f"fixed cap needs a positive integer: {spec!r}")
        return FixedCap(int(value))
    if spec == "dlfp" or spec.startswith("dlfp:"):
        return TailDLFP(with_overrides(defaults, spec.split(":")[1:]))
    if spec == "dlfp-paper":
        return PaperDLFP(replace(PaperParams.of(defaults), max_growth=None), COMPLETION)
    if spec == "dlfp-cadence":
        return PaperDLFP(replace(PaperParams.of(defaults), max_growth=None), CADENCE)
    raise ValueError(f"unknown policy {spec!r}: use {', '.join(POLICY_NAMES)}")


def make_budget_policy(budget_s: float, initial: int, max_tokens: int) -> PrefillPolicy:
    """Sizes isolated background chunks so a step stays within the preemption budget.

    The same law aimed at the budget: a foreground message that arrives meanwhile waits
    for at most about one such step. Never 0, since isolated background prefill must progress.
    """
    initial = max(1, min(initial, max_tokens))
    return TailDLFP(TailParams(budget_s, initial, 1, max_tokens, 1, quantile=0.9, zero_cap=False, cut_at=None),
                    name="budget")
