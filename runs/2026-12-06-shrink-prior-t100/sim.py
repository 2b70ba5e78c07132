"""SIMULATED: the law against the law with shrink_prior=True (patch.diff applied), the study's 16 conditions.
Run from the repository root of a checkout of 0281964 (the candidate's commit):
.venv/bin/python runs/2026-12-06-shrink-prior-t100/sim.py DURATION_S SEEDS (e.g. 300 1,2,3 and 40 1,2,3,4,5,6)."""
import sys
from dataclasses import replace
from dlfp.study import simulate, Condition, summarize
from dlfp.sim import replay_noise
from dlfp.tail import TailDLFP
from dlfp.profiles import load_profile
prof = load_profile("cpu-laptop")
base = prof.controller_params()
traces = {"fixed4": "docs/traces/steps-loaded-1thread-fixed-4.jsonl", "paper": "docs/traces/steps-loaded-1thread-dlfp-paper.jsonl"}
dur = float(sys.argv[1])
seeds = [int(x) for x in sys.argv[2].split(",")]
tot = {"dlfp": [0, 0.0], "shrink_prior=True": [0, 0.0]}
for label, path in traces.items():
    noise = replay_noise(path, 3000e-6 / 1024)
    for T in (300, 150):
        params = replace(base, target_s=T / 1e3)
        for doc in (256, 1536):
            for shift in (1, 2):
                cond = Condition(T, doc, shift, label)
                res = []
                for name, p in (("dlfp", params), ("shrink_prior=True", replace(params, shrink_prior=True))):
                    for seed in seeds:
                        res.append({"design": name, "seed": seed, **simulate(cond, TailDLFP(p), noise, seed, prof, dur)})
                s = summarize(res, T, shift != 1)["designs"]
                a, b = s["dlfp"], s["shrink_prior=True"]
                for k, v in (("dlfp", a), ("shrink_prior=True", b)):
                    tot[k][0] += v["meets"]; tot[k][1] += v["bg_tok_s"]
                print(f"{cond.name}: meets {a['meets']}/{b['meets']} worst phase {a['phase_p99_worst_ms']:.0f}/{b['phase_p99_worst_ms']:.0f} "
                      f"p99 worst {a['p99_worst_ms']:.0f}/{b['p99_worst_ms']:.0f} bg {a['bg_tok_s']:.1f}/{b['bg_tok_s']:.1f} ({b['bg_tok_s']/a['bg_tok_s']:.3f}x)", flush=True)
print(tot)
