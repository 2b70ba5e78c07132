"""The laptop job end to end on the embedded default model, in its smallest setting.

Functional only (files, accounting, exact outputs): timing is a benchmark's job.
"""
import json

import pytest
from click.testing import CliRunner

pytest.importorskip("llama_cpp")

from dlfp.cli import main  # noqa: E402
from dlfp.models import default_model_path  # noqa: E402


@pytest.fixture(scope="module")
def default_model():
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.fail(f"default model missing: {exc} (scripts/setup.sh installs it)")


def test_laptop_smallest(default_model, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(
        main, ["laptop", "--turns", "1", "--max-docs", "1", "--threads", "2", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exact_output_match"] is True
    assert summary["model"] == str(default_model.resolve())
    assert summary["itl_target_ms"] == 100
    assert summary["decode_only_itl_ms"] > 0
    for name in ("unbounded", "dlfp"):
        p = summary["policies"][name]
        assert p["requests_failed"] == 0 and p["bg_docs_done"] == 1 and p["fg_turns_done"] == 1
        for key in ("fg_itl_p50_ms", "fg_itl_p99_ms", "fg_ttft_p99_ms", "bg_prefill_tokens_per_s"):
            assert p[key] is not None and p[key] > 0
        requests = [json.loads(line) for line in open(out / f"requests-{name}.jsonl")]
        assert len(requests) == 2 and all(len(r["token_times"]) == len(r["output_ids"]) for r in requests)
        steps = [json.loads(line) for line in open(out / f"steps-{name}.jsonl")]
        prompt_tokens = sum(r["prompt_len"] for r in requests)
        assert sum(s["n_prefill_fg"] + s["n_prefill_bg"] for s in steps) == prompt_tokens
    dlfp_steps = [json.loads(line) for line in open(out / "steps-dlfp.jsonl")]
    assert all(s["n_prefill_fg"] + s["n_prefill_bg"] <= s["cap"] for s in dlfp_steps if s["guarded"] and s["cap"])


def test_laptop_bad_inputs(tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["laptop", "--model", str(tmp_path / "nope.gguf")])
    assert r.exit_code != 0 and "model file not found" in r.output and "Traceback" not in r.output
    junk = tmp_path / "junk.gguf"
    junk.write_text("hello")
    r = runner.invoke(main, ["laptop", "--model", str(junk)])
    assert r.exit_code != 0 and "not a GGUF" in r.output
    r = runner.invoke(main, ["laptop", "--policies", "dlfp,sometimes"])
    assert r.exit_code != 0 and "unknown policy" in r.output
    r = runner.invoke(main, ["laptop", "--docs", str(tmp_path / "missing")])
    assert r.exit_code != 0 and "not a folder" in r.output


def test_target_below_decode_only_is_said():
    from io import StringIO

    from rich.console import Console

    from dlfp.laptop import target_below_decode_only, target_notes
    from dlfp.report_table import laptop_table

    assert target_below_decode_only(100, 456.0) and not target_below_decode_only(1000, 456.0)
    assert not target_below_decode_only(100, None) and target_notes(100, None) == []
    assert target_notes(1000, 456.0) == []
    (note,) = target_notes(100, 456.0)
    assert "100 ms is below" in note and "456 ms" in note and "--itl-target-ms" in note
    buf = StringIO()
    summary = {"itl_target_ms": 100, "decode_only_itl_ms": 456.0, "exact_output_match": True,
               "notes": [note], "policies": {}}
    laptop_table(summary, Console(file=buf, width=400))
    assert "one decode alone misses it" in buf.getvalue()
