"""`dlfp study` (SIMULATED): the command runs end to end on a recorded trace, drives the
engine's own observer, and its figures move the way the costs say they must."""
import json
from pathlib import Path

from click.testing import CliRunner

from dlfp.study import study

TRACE = Path(__file__).resolve().parents[1] / "docs/traces/steps-loaded-1thread-fixed-4.jsonl"


def test_study_runs_and_orders_fixed_caps(tmp_path):
    out = tmp_path / "study"
    result = CliRunner().invoke(study, ["--trace", f"t={TRACE}", "--targets-ms", "300", "--doc-lens", "256",
                                        "--shifts", "2", "--caps", "1,8", "--seeds", "1",
                                        "--duration-s", "60", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("SIMULATED")
    cond = json.loads((out / "study.json").read_text())["conditions"][0]
    rows = {r["design"]: r for r in cond["runs"]}
    assert set(rows) >= {"fixed:1", "fixed:8", "dlfp", "dlfp-paper"}
    # A larger static cap: longer foreground gaps, more background.
    assert rows["fixed:8"]["itl_p99_ms"] > rows["fixed:1"]["itl_p99_ms"]
    assert rows["fixed:8"]["bg_tok_s_fg_active"] > rows["fixed:1"]["bg_tok_s_fg_active"]
    # dlfp was fed through the engine's observer and held the foreground below a large static cap.
    assert rows["dlfp"]["turns"] > 0 and rows["dlfp"]["shifted"]["itl_p99_ms"] is not None
    assert rows["dlfp"]["itl_p99_ms"] < rows["fixed:8"]["itl_p99_ms"]


def test_two_builds_studies_pair_up_condition_by_condition(tmp_path):
    import gzip
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "scripts" / "study_paired.py"
    spec = importlib.util.spec_from_file_location("study_paired", path)
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)

    def written(name: str, rows: list[tuple[bool, float]]) -> Path:
        conds = [{"summary": {"designs": {"dlfp": {"meets": m, "bg_tok_s": bg}}}} for m, bg in rows]
        path = tmp_path / name
        with gzip.open(path, "wt") as f:
            json.dump({"conditions": conds}, f)
        return path

    cand = written("cand.json.gz", [(True, 2.0), (True, 1.0), (False, 9.0)])
    base = written("base.json.gz", [(True, 1.0), (False, 1.0), (True, 1.0)])
    lines = paired.compare([cand], [base])
    assert lines[0] == "cand.json.gz: met 2, base.json.gz 2 of 3"
    assert lines[-1].startswith("in all: candidate 2, baseline 2 of 3") and "geometric 2.000" in lines[-1]
    assert "over 1 conditions" in lines[-1]  # only the condition both met is paired
