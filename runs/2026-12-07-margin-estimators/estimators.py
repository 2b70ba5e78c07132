"""How well three estimators of the margin trade its size against steps that overrun it, on
the step traces of the controller runs of 2026-12-07 (T = 100 and beside the neighbour,
`dlfp` arms). Each guarded chunk step's ratio measured / recorded prediction is scored
against the margin each estimator gives from the 128 chunk ratios before it (at least 32):
the empirical quantile (the law's, unweighted here), a log-ratio AR(1) fit whose margin is
the fit's forecast from the latest ratio plus the residuals' quantile (the ratios of
consecutive steps correlate), and the Harrell-Davis quantile (a weighted mean of order
statistics: less noisy at a tail). A better estimator overruns as rarely with a smaller
mean margin. Run from the repository root with .venv/bin/python."""
import glob
import math

import numpy as np
from scipy.stats.mstats import hdquantiles

from dlfp.trace import read_steps

RUNS = ("runs/2026-12-07-faster-learned-nn", "runs/2026-12-07-series-controller-nn",
        "runs/2026-12-07-series-controller-t100", "runs/2026-12-07-faster-learned-t100")
WINDOW, LEAST = 128, 32


def log_ratios(path: str) -> np.ndarray:
    return np.array([math.log(r.duration_s * 1e3 / r.predicted_ms) for r in read_steps(path)
                     if r.guarded and r.n_prefill_fg + r.n_prefill_bg and r.predicted_ms])


def margin(window: np.ndarray, latest: float, q: float, how: str) -> float:
    if how == "empirical":
        return float(np.quantile(window, q, method="inverted_cdf"))
    if how == "harrell-davis":
        return math.log(float(hdquantiles(np.exp(window), prob=[q])[0]))
    before, after = window[:-1], window[1:]  # AR(1) on log ratios
    design = np.vstack([np.ones_like(before), before]).T
    coef, *_ = np.linalg.lstsq(design, after, rcond=None)
    return float(coef[0] + coef[1] * latest + np.quantile(after - design @ coef, q))


series = [log_ratios(p) for run in RUNS for p in sorted(glob.glob(f"{run}/steps-*-dlfp.jsonl.gz"))]
pairs = np.array([(x[i - 1], x[i]) for x in series for i in range(1, len(x))])
print(f"{sum(map(len, series))} chunk steps in {len(series)} traces; "
      f"lag-1 correlation of log ratios {np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]:.2f}")
print("estimator, q: share of steps over the margin / over 1.1 x the margin, geometric mean margin")
for how in ("empirical", "AR(1)", "harrell-davis"):
    for q in (0.97, 0.98, 0.99):
        over = over_goal = n = 0
        total = 0.0
        for x in series:
            for t in range(LEAST + 1, len(x)):
                m = margin(x[max(0, t - WINDOW):t], x[t - 1], q, how)
                over += x[t] > m
                over_goal += x[t] > m + math.log(1.1)
                total += m
                n += 1
        print(f"{how:>13} {q}: {over / n:.4f} / {over_goal / n:.4f}, {math.exp(total / n):.3f}")
