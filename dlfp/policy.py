"""The prefill-cap policy interface: how many prompt tokens may join a step that also decodes.

Pure and clock-free: a policy is told what was observed and answers with a decision
(a cap and why). The engine decides *what* it observes (completed step time or the
scheduler-call interval); the policy records which source it was built for so traces
say so. The laws: dlfp/paper.py (the paper's equation (2)), dlfp/tail.py (the
tail-aware controller, `dlfp`); dlfp/controller.py maps a policy's name to one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields, replace
from typing import Mapping

COMPLETION = "completion"  # completed device time of the step (what dlfp uses)
CADENCE = "cadence"  # interval between scheduler calls (the paper's proxy; reproduction only)
SOURCES = (COMPLETION, CADENCE)

# Consecutive observations at the minimum cap that still miss the target before
# a law declares the target unreachable.
UNREACHABLE_AFTER = 8


@dataclass(frozen=True)
class StepShape:
    """What an observed step carried, for policies that learn the step's cost.

    Positions are context positions (0-based): a prompt token deep in a long
    document attends over more cells than one near its start, so its cost grows
    with position.
    """

    n_decode: int = 0  # decode tokens (one per decoding sequence)
    n_prefill: int = 0  # prompt tokens of all chunks together
    prefill_position_sum: int = 0  # sum over prompt tokens of their positions
    decode_position_sum: int = 0  # sum over decode tokens of their positions
    n_chunks: int | None = None  # prompt chunks (sequences carrying prompt tokens); None: unknown
    n_protected: int | None = None  # of n_decode, protected (foreground) decodes; None: all of them

    @property
    def itls(self) -> int:
        """Foreground inter-token gaps the step ends: one per protected decode (at least one,
        so a step whose decodes are unknown still counts once)."""
        return max(1, self.n_decode if self.n_protected is None else self.n_protected)

    @property
    def mean_prefill_position(self) -> float:
        return self.prefill_position_sum / self.n_prefill if self.n_prefill else 0.0


# Why a cap is what it is: the decision record's vocabulary.
RULES = {
    "unbounded": "no cap",
    "fixed": "a static cap",
    "initial": "nothing learned yet: the profile's initial cap",
    "paper": "equation (2) on the last observed step",
    "prior": "planned from the decode-only steps before a prompt token was measured (at most initial; at least the two tokens that measure one, where they fit the target)",
    "model": "the largest chunk whose predicted time times the margin meets the target",
    "minimum": "not even the minimum chunk fits, and background may not be held out",
    "measured": "the largest chunk the margin's window measured: a margin under 1 is trusted no further, and a larger chunk at a margin of 1 does not fit",
    "miss": "the last step missed the target: the model's chunk at that step's own measured / predicted ratio",
    "faster": "the model's chunk, just after the model was scaled to a faster device (its latest chunk steps ran well under their prediction)",
    "wait": "a new turn's prompt waits: not even its minimum chunk fits beside the streaming chats, whose targets come first",
    "hold": "not even the minimum chunk fits: background prompt tokens are held out (cap 0)",
    "probe": "a minimum chunk while background is held out, to measure whether it fits again (two tokens where none has been measured and two fit the target)",
    "cut": "the step before was cut at its deadline: its protected decodes run alone",
}


@dataclass(frozen=True)
class Decision:
    """What a policy chose for one guarded step, and why (stored in every step trace row)."""

    cap: int | None
    rule: str  # a key of RULES
    n_decode: int | None = None  # the decodes the step was planned for
    predicted_ms: float | None = None  # the cost model's time for the planned step (no margin)
    margin: float | None = None  # measured / predicted quantile the prediction is multiplied by
    setpoint_ms: float | None = None  # target / margin: what the prediction must meet
    cut_ms: float | None = None  # a step with prompt tokens still running this long is cut (None: never)
    position: int | None = None  # where the planned chunk starts (a deeper token costs more)
    decode_ms: float | None = None  # the cost model's time for the step's decodes alone (a cut step's rerun)


class PrefillPolicy(ABC):
    """Caps the prompt tokens of a step that overlaps an active decode ("guarded").

    Contract: `cap()` is asked once per guarded step; `observe()` gets the latency
    of each guarded step that ran; `reset()` is called when nothing decodes, so an
    isolated prefill is never capped by the policy.
    """

    name: str = "policy"
    source: str = COMPLETION
    params = None  # the policy's parameters (a dataclass), where it has any
    # Sizes a new turn's prompt beside the streams by its own model: background waits while
    # it loads (dlfp.scheduler). A static cap, or none, shares the step as a stock runtime does.
    plans_turns: bool = False
    # A streaming reply that has spent the ITLs over its target its own P99 absorbs is planned
    # against target / spent_factor (dlfp.scheduler.Scheduler.itl_target_s); 1: never.
    spent_factor: float = 1.0

    @abstractmethod
    def decide(self, n_decode: int | None = None, target_s: float | None = None,
               position: int | None = None) -> Decision:
        """The prompt-token cap for the next guarded step (None: no cap) and why. `n_decode`:
        the decodes that step will carry, where the caller knows it (a policy that learns the
        step's cost plans for them). `target_s`: the ITL target this step must meet where the
        streaming requests named one (the tightest), else None: the policy's own. `position`:
        where the step's first prompt chunk would start (a prompt token deep in a context
        costs more), where known. Asked once per guarded step: a policy may count the asks."""

    def cap(self, n_decode: int | None = None, target_s: float | None = None,
            position: int | None = None) -> int | None:
        return self.decide(n_decode, target_s, position).cap

    def observe(self, latency_s: float, cap: int | None = None, shape: StepShape | None = None,
                cut: bool = False) -> None:
        """Latency of a guarded step that has completed.

        `cap` is the cap that step was planned with, when the caller knows it and
        it may differ from the current one (a pipelined engine such as vLLM's async
        scheduling plans the next step before this one completes). `shape` says
        what the step carried, where the caller knows it. `cut`: the step was cut at
        its decision's `cut_ms` (it would have run at least `latency_s`; nothing ran).
        """

    def reset(self) -> None:
        """Nothing decodes any more: forget the interference state."""

    def device_changed(self, cost_factor: float | None = None) -> None:
        """The device got faster or slower under us (the step threads changed): what was
        learned about its step times no longer holds. `cost_factor`: how much dearer a
        step is expected to be now (2.0 going from two threads to one), where known."""
        self.reset()

    @property
    def target_unreachable(self) -> bool:
        return False

    def describe(self) -> dict:
        """Name, timing source and every parameter, whole (a field added later is never dropped)."""
        extra = params_to_dict(self.params) if self.params is not None else {}
        return {"name": self.name, "source": self.source, **extra}


class Unbounded(PrefillPolicy):
    """No cap: the whole pending prompt (up to the batch size) joins the step."""

    name = "unbounded"

    def decide(self, n_decode: int | None = None, target_s: float | None = None,
               position: int | None = None) -> Decision:
        return Decision(None, "unbounded", n_decode)


class FixedCap(PrefillPolicy):
    """A static cap: the classic fixed chunked-prefill baseline."""

    def __init__(self, tokens: int):
        if tokens < 1:
            raise ValueError(f"fixed cap must be >= 1 token, got {tokens}")
        self.tokens = tokens
        self.name = f"fixed:{tokens}"

    def decide(self, n_decode: int | None = None, target_s: float | None = None,
               position: int | None = None) -> Decision:
        return Decision(self.tokens, "fixed", n_decode)

    def describe(self) -> dict:
        return {"name": self.name, "source": self.source, "tokens": self.tokens}


def params_to_dict(p) -> dict:
    """Every field of the parameters, the target in ms: what traces, configs and the
    vLLM plug-in's settings carry. Serialised from the dataclass, so none is dropped."""
    d = asdict(p)
    return {"target_ms": d.pop("target_s") * 1e3, **d}


def params_from_dict(values: Mapping, base):
    """`base` with the fields `values` names (as params_to_dict spells them) replaced.

    Values may be strings (environment variables); each is converted to the type of
    the field's value in `base`. Raises ValueError naming an unknown or bad key.
    """
    names = {f.name for f in fields(base)}
    changes = {}
    for key, raw in values.items():
        name = "target_s" if key == "target_ms" else key
        if key == "target_s" or name not in names:
            raise ValueError(f"unknown controller parameter {key!r}; known: {', '.join(params_to_dict(base))}")
        current = getattr(base, name)
        try:
            if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none")):
                value = None
            elif isinstance(current, bool):
                value = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
            elif isinstance(current, int):
                value = int(raw)
            else:
                value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"controller parameter {key!r}: not a number: {raw!r}") from None
        changes[name] = value / 1e3 if key == "target_ms" and value is not None else value
    return replace(base, **changes)
