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
