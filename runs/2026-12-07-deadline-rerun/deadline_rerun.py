"""A lead scored on the kept traces, not built: the deadline cut placed so that the cut step's
ITL, the decodes' rerun included, ends at `cut_at` x T (the ITL a reply's own P99 <= 1.1 T
absorbs once), instead of cutting at `cut_at` x T and rerunning after it. Scored with two
estimates of the rerun: the contention watch's bound (threads x the decision's decode-only
time, `decode_ms`) and the decode-only time alone.

From the step and request traces of the `dlfp` arms beside the neighbour (T = 100 ms) kept
from 2026-12-06 and 2026-12-07, not the -base runs of 1d43624. For each guarded step with
prompt tokens under a deadline (`cut_ms`), the lead's deadline is cut_ms less the rerun:
- a step cut at its deadline would have been cut that much sooner: each reply's ITL that
  ends at its rerun is shorter by it (the lateness of the cut and the rerun as measured);
- a step that ran whole past the lead's deadline would have been cut there and rerun: its
  ITLs become the lead's deadline plus the predicted rerun, and its prompt tokens are lost.
Each reply's own P99 is recomputed with its ITLs so replaced. Run from the repository root
with .venv/bin/python."""
import glob
import gzip
import json

from dlfp.metrics import ITL_GOAL_TOLERANCE, percentile

TARGET_S = 0.1
# The runs kept when it was scored (a run kept later is not in its results.txt).
RUNS = ("2026-12-06-aa", "2026-12-06-controller", "2026-12-06-final-controller", "2026-12-06-hindsight",
        "2026-12-06-hybrid-controller", "2026-12-06-kprior-controller", "2026-12-06-kprior-repeat-controller",
        "2026-12-06-late-watch", "2026-12-06-margin-carried", "2026-12-06-prior-from", "2026-12-06-probe-again",
        "2026-12-06-q098-series", "2026-12-06-repeat-controller", "2026-12-06-share-controller",
        "2026-12-06-unguarded-controller", "2026-12-07-faster-learned", "2026-12-07-faster-passes",
        "2026-12-07-goodput", "2026-12-07-head-controller", "2026-12-07-series-controller")
runs = [f"runs/{r}-nn" for r in RUNS]


def score(rerun_of) -> None:
    cut_steps = newly_cut = lost_tokens = chunk_steps = 0
    replies = failed_now = failed_lead = rescued = broken = 0
    for run in runs:
        for spath in sorted(glob.glob(f"{run}/steps-*-dlfp.jsonl.gz")):
            steps = [json.loads(line) for line in gzip.open(spath, "rt")]
            if not steps or "decode_ms" not in steps[0] or "cut_by" not in steps[0]:
                continue
            rpath = spath.replace("/steps-", "/requests-")
            # The change each step's ITLs would see under the lead, keyed by the end of the step
            # that delivers their token (a cut step's token comes from its rerun, the next step).
            shift: dict[float, float] = {}
            for i, s in enumerate(steps):
                n = s["n_prefill_fg"] + s["n_prefill_bg"] + (s.get("n_prefill_cut") or 0)
                if not s["guarded"] or s.get("cut_ms") is None or s.get("decode_ms") is None:
                    continue
                if n == 0 and s["cut_by"] is None:
                    continue
                chunk_steps += 1
                rerun_ms = rerun_of(s)
                lead_ms = s["cut_ms"] - rerun_ms
                ms = s["duration_s"] * 1e3
                if s["cut_by"] == "deadline" and i + 1 < len(steps):
                    cut_steps += 1
                    shift[round(steps[i + 1]["t1"], 3)] = -rerun_ms
                elif s["cut_by"] is None and ms > lead_ms:
                    newly_cut += 1
                    lost_tokens += n
                    shift[round(s["t1"], 3)] = lead_ms + rerun_ms - ms
            try:
                lines = gzip.open(rpath, "rt").read().splitlines()
            except FileNotFoundError:
                continue
            for line in lines:
                r = json.loads(line)
                if r["priority"] != "foreground" or r["tag"] == "warmup" or len(r["token_times"]) < 11:
                    continue
                times, t = r["token_times"], r.get("itl_target_s") or TARGET_S
                itls = [b - a for a, b in zip(times, times[1:])]
                lead = []  # a token is stamped after the step that delivers it ends: matched within 30 ms
                for x, b in zip(itls, times[1:]):
                    d = next((v for k, v in shift.items() if 0 <= b - k < 0.03), 0.0)
                    lead.append(x + d / 1e3)
                replies += 1
                now_fails = percentile(itls, 99) > ITL_GOAL_TOLERANCE * t
                lead_fails = percentile(lead, 99) > ITL_GOAL_TOLERANCE * t
                failed_now += now_fails
                failed_lead += lead_fails
                rescued += now_fails and not lead_fails
                broken += lead_fails and not now_fails
    print(f"runs: {len(runs)}; guarded steps with prompt tokens under a deadline: {chunk_steps}")
    print(f"cut at the deadline: {cut_steps}; would be cut under the lead (ran whole past it): {newly_cut}, "
          f"their prompt tokens lost: {lost_tokens}")
    print(f"replies: {replies}; failing their ITL goal now: {failed_now}, under the lead: {failed_lead} "
          f"(rescued {rescued}, newly failing {broken})")


print("rerun: threads x decode-only time (the contention watch's bound)")
score(lambda s: s["threads"] * s["decode_ms"])
print("rerun: the decode-only time")
score(lambda s: s["decode_ms"])
