"""Every step the rule `faster` decided in the step traces of runs/2026-12-04-* to
runs/2026-12-07-*: the chunk sizes of the 8 chunk steps before it, and how many of the
chunk steps among the 20 steps from it ran over 1.1 T or were cut.
    .venv/bin/python runs/2026-12-07-faster-events/faster_events.py > runs/2026-12-07-faster-events/results.txt"""
import glob

from dlfp.trace import StepRecord, read_steps


def prompt_tokens(s: StepRecord) -> int:
    return s.n_prefill_fg + s.n_prefill_bg + s.n_prefill_cut


events = []
LATER = "runs/2026-12-07-faster-"  # runs kept after this was run: not in its results.txt
for f in sorted(f for f in glob.glob("runs/2026-12-0[4567]-*/steps-*.jsonl.gz") if not f.startswith(LATER)):
    steps = read_steps(f)
    for i, t in enumerate(steps):
        if t.rule != "faster":
            continue
        before = [s for s in steps[max(0, i - 30):i]
                  if s.guarded and s.rule not in (None, "cut") and prompt_tokens(s) > 0][-8:]
        after = [s for s in steps[i:i + 20] if s.guarded and s.predicted_ms and prompt_tokens(s) > 0]
        target_ms = t.setpoint_ms * t.margin
        over = sum(1 for s in after if s.duration_s * 1e3 > 1.1 * target_ms or s.cut_by)
        events.append((f.split("/")[1], f.split("steps-")[1][:-9], round(t.t0, 1), t.threads,
                       [prompt_tokens(s) for s in before], over, len(after)))
ones = [e for e in events if all(n == 1 for n in e[4])]
print(f"{len(events)} steps decided by `faster`; {len(ones)} after one-token chunks only")
print(f"chunk steps over 1.1 T or cut among the 20 steps from each: {sum(e[5] for e in events)} of {sum(e[6] for e in events)}")
for e in events:
    print(*e)
