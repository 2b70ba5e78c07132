"""SIMULATED: the law against the law with one parameter set (prior_from=8 where none is given;
the candidate's commit checked out), the study's 16 conditions. Run from the repository root:
.venv/bin/python runs/2026-12-06-prior-from-t100/sim.py DURATION_S SEEDS [NAME=VALUE] (e.g. 300 1,2,3;
on 0281964: 40 1,2,3,4,5,6 shrink_prior=true)."""
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
cand = sys.argv[3] if len(sys.argv) > 3 else "prior_from=8"
key, value = cand.split("=")
cand_value = {"true": True, "false": False}[value.lower()] if value.lower() in ("true", "false") else int(value)
tot = {"dlfp": [0, 0.0], cand: [0, 0.0]}
for label, path in traces.items():
    noise = replay_noise(path, 3000e-6 / 1024)
    for T in (300, 150):
        params = replace(base, target_s=T / 1e3)
        for doc in (256, 1536):
            for shift in (1, 2):
                cond = Condition(T, doc, shift, label)
                res = []
                for name, p in (("dlfp", params), (cand, replace(params, **{key: cand_value}))):
                    for seed in seeds:
                        res.append({"design": name, "seed": seed, **simulate(cond, TailDLFP(p), noise, seed, prof, dur)})
                s = summarize(res, T, shift != 1)["designs"]
                a, b = s["dlfp"], s[cand]
                for k, v in (("dlfp", a), (cand, b)):
                    tot[k][0] += v["meets"]; tot[k][1] += v["bg_tok_s"]
                print(f"{cond.name}: meets {a['meets']}/{b['meets']} worst phase {a['phase_p99_worst_ms']:.0f}/{b['phase_p99_worst_ms']:.0f} "
                      f"p99 worst {a['p99_worst_ms']:.0f}/{b['p99_worst_ms']:.0f} bg {a['bg_tok_s']:.1f}/{b['bg_tok_s']:.1f} ({b['bg_tok_s']/a['bg_tok_s']:.3f}x)", flush=True)
print(tot)
