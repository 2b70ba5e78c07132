"""The GPU check's verdict from a bench's paired.json: accounting decides, agreement is reported.

vLLM does not promise identical greedy outputs in bf16 when the same prompt is
chunked differently (its kernels are not batch-invariant unless VLLM_BATCH_INVARIANT=1),
and the arms chunk differently by design. So a timing check fails on lost or
unaccounted requests, and on mismatching outputs only when batch invariance is on.
    python -m dlfp.backends.vllm.agreement OUT/paired.json
"""
from __future__ import annotations

import json
import os
import sys


def verdict(paired: dict, batch_invariant: bool) -> tuple[bool, list[str]]:
    ok, lines = True, []
    agreement = paired.get("agreement", {})
    for arm, cand in paired["paired"]["candidates"].items():
        compared = sum(a.get(arm, {}).get("compared", 0) for a in agreement.values())
        mismatched = sum(len(a.get(arm, {}).get("mismatches", [])) for a in agreement.values())
        note = "required: batch invariance is on" if batch_invariant else "reported, not required (bf16, no batch invariance)"
        lines.append(f"{arm}: token accounting {'ok' if cand['reconciled'] else 'FAILED'}; greedy outputs identical "
                     f"to the baseline in {compared - mismatched}/{compared} requests ({note})")
        ok &= bool(cand["reconciled"]) and (not batch_invariant or bool(cand["exact_output_agreement"]))
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paired = json.loads(open(args[0]).read())
    ok, lines = verdict(paired, os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"))
    for line in lines:
        print(line, file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
