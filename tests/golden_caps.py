"""Golden caps: the per-step caps the controllers choose on fixed scenarios.

Two kinds of scenario, each deterministic:
- closed loops on synthetic CPU-like step costs (the controller's cap decides the next
  step's prompt tokens), with noise, decode counts that change, resets, cost shifts and
  a device change;
- open-loop replays of committed step traces (docs/traces/steps-*.jsonl): each guarded
  step is asked for a cap with its recorded decode count and observed with its recorded
  time and shape, and each budgeted step feeds the budget policy, as the observer does.

`tests/data/golden_caps.json` holds what the controller chose when the scenarios were
recorded; test_golden_caps.py fails where a restructuring changes one cap. Rewrite it
only for a deliberate change of the law:  .venv/bin/python tests/golden_caps.py --write
"""
from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "data" / "golden_caps.json"
TRACES = sorted((ROOT / "docs" / "traces").glob("steps-*.jsonl"))


def _controller():
    """The controllers' names in one namespace (imported late: --write runs outside pytest)."""
    from types import SimpleNamespace

    from dlfp import controller, paper, policy, tail

    return SimpleNamespace(StepShape=policy.StepShape, TailParams=tail.TailParams, TailDLFP=tail.TailDLFP,
                           make_budget_policy=controller.make_budget_policy, PaperDLFP=paper.PaperDLFP)


def pass_cost_ms(n: int, decodes: int, pos: float, factor: float) -> float:
    """A CPU step paying a pass per sequence and less per further prompt token, dearer deep
    in a context."""
    return factor * (18.0 + 16.0 * (decodes - 1 + (n > 0)) + (8.0 + 4.0 * pos / 1024) * max(0, n - 1))


def closed_loop(policy, steps: int, seed: int, sigma: float, factor=lambda k: 1.0, decodes_of=lambda k: 1,
                reset_every: int | None = None, idle_every: int = 6, device_change_at: int | None = None,
                protected_of=lambda k: None, decisions: list | None = None, idle_first: int = 0) -> list:
    """The caps asked over `steps` guarded steps; each step's Decision is appended to `decisions`."""
    c = _controller()
    rng = random.Random(seed)
    caps = []
    for k in range(steps):
        if reset_every and k % reset_every == 0:
            policy.reset()
        if device_change_at is not None and k == device_change_at:
            policy.device_changed(2.0)
        d, pos = decodes_of(k), (k * 7) % 1800
        decision = policy.decide(d, position=pos)  # as the engine asks: where the next chunk starts
        cap = decision.cap
        caps.append(cap)
        if decisions is not None:
            decisions.append(decision)
        n = 0 if cap is None or k < idle_first or (idle_every and k % idle_every == idle_every - 1) else cap
        f = factor(k) * (2.0 if device_change_at is not None and k >= device_change_at else 1.0)
        ms = pass_cost_ms(n, d, pos, f) * math.exp(rng.gauss(0, sigma))
        if rng.random() < 0.01:
            ms *= 3.0  # a preempted step now and then: the tail's business
        shape = c.StepShape(d, n, n * pos + n * (n - 1) // 2, d * pos, 1 if n else 0, protected_of(k))
        policy.observe(ms / 1e3, cap=cap, shape=shape)
    return caps


def closed_loop_scenarios() -> dict[str, list]:
    c = _controller()
    cpu = c.TailParams(0.100, 4, 1, 256, 1, max_growth=1.25, zero_cap=True)
    t50 = c.TailParams(0.050, 4, 1, 256, 1, max_growth=1.25, zero_cap=True)
    paper = c.TailParams(0.100, 4, 1, 256, 1)
    out = {
        "tail-quiet": closed_loop(c.TailDLFP(cpu), 600, 1, 0.05),
        "tail-noisy": closed_loop(c.TailDLFP(cpu), 600, 2, 0.25),
        "tail-two-decodes": closed_loop(c.TailDLFP(cpu), 600, 3, 0.1, decodes_of=lambda k: 1 + (k // 40) % 3),
        "tail-shift": closed_loop(c.TailDLFP(cpu), 900, 4, 0.1, factor=lambda k: 3.0 if 300 <= k < 600 else 1.0),
        "tail-t50": closed_loop(c.TailDLFP(t50), 600, 5, 0.08, decodes_of=lambda k: 1 + (k // 100) % 2),
        "tail-resets": closed_loop(c.TailDLFP(cpu), 600, 6, 0.1, reset_every=75),
        "tail-device-change": closed_loop(c.TailDLFP(cpu), 600, 7, 0.1, device_change_at=300),
        "tail-two-chats": closed_loop(c.TailDLFP(cpu), 600, 8, 0.15, decodes_of=lambda k: 2 + (k // 50) % 2,
                                      protected_of=lambda k: 2),
        "tail-no-zero": closed_loop(c.TailDLFP(c.TailParams(0.050, 4, 1, 256, 1, zero_cap=False)), 400, 9, 0.1,
                                    decodes_of=lambda k: 2),
        "paper-completion": closed_loop(c.PaperDLFP(paper), 400, 10, 0.1),
        "paper-growth": closed_loop(c.PaperDLFP(c.TailParams(0.100, 4, 1, 256, 1, max_growth=1.25)), 400, 11, 0.2),
        "budget": closed_loop(c.make_budget_policy(0.5, 32, 512), 300, 12, 0.1, decodes_of=lambda k: 0),
    }
    return out


def replay(path: Path, params) -> dict[str, list]:
    """Feed a recorded step trace to a fresh TailDLFP and a budget policy, as the observer
    does: guarded steps to the policy (cap asked with the step's decodes), budgeted steps
    (isolated background prefill under a budget cap) to the budget policy."""
    c = _controller()
    from dlfp.observer import plan_shape

    policy, budget = c.TailDLFP(params), c.make_budget_policy(0.5, 32, 512)
    caps, bg_caps = [], []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        n = r["n_prefill_fg"] + r["n_prefill_bg"]
        shape = plan_shape([0] * r["n_decode"], [(0, n)] if n else [])
        if r["guarded"]:
            caps.append(policy.cap(r["n_decode"] or None))
            policy.observe(r["duration_s"], cap=r["cap"], shape=shape)
        else:
            policy.reset()
            if r["n_prefill_bg"] > 0 and r.get("bg_cap") is not None:
                bg_caps.append(budget.cap())
                budget.observe(r["duration_s"], cap=r["bg_cap"], shape=shape)
    return {"caps": caps, "budget_caps": bg_caps}


def replay_scenarios() -> dict[str, dict]:
    c = _controller()
    out = {}
    for target in (0.050, 0.100):
        params = c.TailParams(target, 4, 1, 256, 1, max_growth=1.25, zero_cap=True)
        for path in TRACES:
            out[f"{path.stem}@T={target * 1e3:g}"] = replay(path, params)
    return out


def record() -> dict:
    return {"closed_loop": closed_loop_scenarios(), "replays": replay_scenarios()}


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: golden_caps.py --write   (records today's caps as the golden ones)")
    sys.path.insert(0, str(ROOT))
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(record()) + "\n")
    print(f"wrote {GOLDEN}")
