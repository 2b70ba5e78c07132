"""Per trial of the T = 100 and T = 50 runs of `faster` held while the margin is young: thread
changes, windows of 8 chunk steps whose median ratio to the recorded prediction was under 0.7
(where the rule as it was could fire), and decode-only steps over 1.1 T (no cap shortens
them). Run from the repository root."""
import statistics

from dlfp.trace import read_steps

for cond, limit in (("t100", 110.0), ("t50", 55.0)):
    for seed in ("1270", "1271", "1272"):
        for arm in ("dlfp", "dlfp-faster_any-true"):
            path = f"runs/2026-12-07-faster-learned-{cond}/steps-{seed}-{arm}.jsonl.gz"
            rows = read_steps(path)
            guarded = [r for r in rows if r.guarded]
            ratios = [r.duration_s * 1e3 / r.predicted_ms for r in guarded
                      if r.n_prefill_fg + r.n_prefill_bg > 0 and r.predicted_ms]
            low = sum(statistics.median(ratios[i - 8:i]) < 0.7 for i in range(8, len(ratios) + 1))
            alone = sum(r.n_prefill_fg + r.n_prefill_bg == 0 and r.duration_s * 1e3 > limit for r in guarded)
            changes = sum(a.threads != b.threads for a, b in zip(rows, rows[1:]))
            print(f"{cond} {seed} {arm}: thread changes {changes}, low-ratio windows {low}, "
                  f"decode-only steps over 1.1 T {alone}")
