"""The README's and docs' tables are drawn from kept runs, and nothing else.

Every table between `<!-- dlfp-report DIR KIND -->` markers is regenerated from its
runs/ folder and must match the committed text: a figure typed by hand, or a run
folder changed without `dlfp report --docs`, fails here. The kept-run layout
(dated folders with a config.json, compressed traces) and `.gitignore` must agree.
"""
from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlfp.bench.cli import report
from dlfp.bench.doc_tables import MARKER, blocks, doc_files, rewrite_text
from dlfp.runs import compress_traces, is_kept, kept_runs

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> subprocess.CompletedProcess | None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.parametrize("doc", doc_files(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_matches_its_run(doc):
    text = doc.read_text()
    assert rewrite_text(text, ROOT) == text, (
        f"{doc.relative_to(ROOT)}: a table differs from the run folder its marker names; "
        "run `dlfp report --docs` (never edit a generated table by hand)")


def test_the_readme_and_docs_draw_their_tables_from_kept_runs():
    found = [(doc, rel) for doc in doc_files(ROOT) for rel, _ in blocks(doc.read_text())]
    assert any(doc.name == "README.md" for doc, _ in found), "the README's laptop table is generated"
    for doc, rel in found:
        folder = ROOT / rel
        assert rel.startswith("runs/") and is_kept(folder), f"{doc.name}: {rel} is not runs/<yyyy-mm-dd>-<name>"
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg.get("command") or cfg.get("files"), f"{rel}/config.json names no command"
        if cfg.get("reconstructed"):  # what was not recorded is null, never guessed
            assert cfg["git"] == {"commit": None, "clean": None} and cfg["machine"] is None
            assert re.fullmatch(r"[0-9a-f]{40}", cfg["recorded_in_commit"])
        else:
            assert cfg["git"]["commit"] and cfg["machine"]["logical_cores"], f"{rel}/config.json lacks provenance"


def test_a_figure_edited_by_hand_is_redrawn():
    text = (ROOT / "docs/benchmarks.md").read_text()
    block = next(MARKER.finditer(text))
    body = block.group(4)
    digit = re.search(r"\d", body)
    changed = body[:digit.start()] + str((int(digit.group()) + 1) % 10) + body[digit.end():]
    edited = text[:block.start(4)] + changed + text[block.end(4):]
    assert rewrite_text(edited, ROOT) == text


def test_every_folder_under_runs_is_a_kept_run_with_its_config():
    tracked = _git("ls-files", "runs")
    if tracked is None:
        pytest.skip("not a git checkout")
    folders = {Path(p).parts[1] for p in tracked.stdout.split()}
    assert folders, "runs/ holds the kept runs the docs cite"
    for name in folders:
        assert is_kept(ROOT / "runs" / name), f"runs/{name} is not runs/<yyyy-mm-dd>-<name>"
        assert (ROOT / "runs" / name / "config.json").is_file(), f"runs/{name} has no config.json"
    assert {p.name for p in kept_runs(ROOT / "runs")} >= folders


@pytest.mark.parametrize("path, ignored", [
    ("runs/scratch/trials.jsonl", True),
    ("runs/bench_series.log", True),
    ("runs/2030-01-01-x/trials.jsonl", False),
    ("runs/2030-01-01-x/config.json", False),
    ("runs/2030-01-01-x/steps-801-dlfp.jsonl", True),
    ("runs/2030-01-01-x/steps-801-dlfp.jsonl.gz", False),
    ("runs/2030-01-01-x/requests-801-dlfp.jsonl", True),
])
def test_gitignore_keeps_dated_runs_and_their_compressed_traces(path, ignored):
    out = _git("check-ignore", "-q", "--no-index", path)
    if out is None:
        pytest.skip("not a git checkout")
    assert (out.returncode == 0) == ignored


def test_compressed_traces_are_byte_stable(tmp_path):
    trace = tmp_path / "steps-801-dlfp.jsonl"
    trace.write_text('{"t0": 0.0, "t1": 0.01}\n' * 50)
    (tmp_path / "trials.jsonl").write_text("{}\n")
    first = compress_traces(tmp_path)
    assert [p.name for p in first] == ["steps-801-dlfp.jsonl.gz"]
    data = first[0].read_bytes()
    assert compress_traces(tmp_path)[0].read_bytes() == data  # a rerun changes nothing in git
    assert gzip.decompress(data) == trace.read_bytes()


def test_the_laptop_job_writes_its_provenance(tmp_path):
    from dlfp.laptop import write_outputs

    summary = {"model": None, "backend": {"name": "sim", "n_threads": 2}, "profile": "cpu-laptop",
               "itl_target_ms": 100.0, "controller": {"target_ms": 100.0}, "policies": {"dlfp": {}}}
    write_outputs(tmp_path, summary, [])
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["command"] and "commit" in cfg["git"] and "clean" in cfg["git"]
    assert cfg["machine"]["threads_used"] == 2 and cfg["machine"]["logical_cores"]
    assert len(cfg["machine"]["load_average"]) == 3  # how busy the shared machine was
    assert cfg["itl_target_ms"] == 100.0 and cfg["policies"] == ["dlfp"]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def _fake_checkout(root: Path) -> Path:
    run = root / "runs" / "2030-01-01-tiny"
    run.mkdir(parents=True)
    rows = [{"seed": 1, "policy": arm, "itl_p99_ms": p99, "itl_max_ms": p99 * 2, "ttft_p99_ms": 5.0,
             "bg_prompt_tok_s_client": None, "completed": 2, "submitted": 2} for arm, p99 in (("a", 10.0), ("b", 7.5))]
    (run / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps({"command": "dlfp bench --out x", "git": {"commit": "f" * 40,
                                                 "clean": True}, "machine": None}))
    readme = root / "README.md"
    readme.write_text("# x\n\n<!-- dlfp-report runs/2030-01-01-tiny trials -->\n<!-- /dlfp-report -->\n")
    return readme


def test_report_docs_draws_and_checks_the_tables(tmp_path, monkeypatch):
    readme = _fake_checkout(tmp_path)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert runner.invoke(report, ["--check-docs"]).exit_code == 1  # the block is empty: not drawn yet
    drawn = runner.invoke(report, ["--docs"])
    assert drawn.exit_code == 0, drawn.output
    text = readme.read_text()
    assert "| 1 | b | 7.5 | 15.0 | 5.0 | - | 2/2 |" in text and "commit ffffffffff" in text
    assert runner.invoke(report, ["--check-docs"]).exit_code == 0
    readme.write_text(text.replace("7.5", "6.5"))
    checked = runner.invoke(report, ["--check-docs"])
    assert checked.exit_code == 1 and "README.md" in checked.output


def test_a_sweep_table_of_a_run_without_fixed_caps_is_a_clear_error(tmp_path, monkeypatch):
    readme = _fake_checkout(tmp_path)  # arms a and b: neither dlfp nor a fixed cap
    readme.write_text(readme.read_text().replace(" trials -->", " sweep -->"))
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(report, ["--docs"])
    assert out.exit_code != 0 and "a sweep needs dlfp and a fixed:N arm (arms: a, b)" in out.output


def test_side_by_side_sets_a_variant_arm_beside_the_baselines_one_arm(tmp_path):
    """`dlfp:turn_first=false` from this build is set beside the baseline's `dlfp`; another
    policy (a fixed cap) is not, and each arm gets its own summary lines."""
    from dlfp.bench.doc_tables import side_by_side

    def trial(seed: int, policy: str, bg: float, p99: float) -> dict:
        return {"seed": seed, "policy": policy, "bg_prefill_tok_s_fg_active": bg, "itl_p99_ms": p99,
                "itl_max_ms": p99 + 10}

    def write(folder: Path, rows: list[dict]) -> None:
        folder.mkdir()
        (folder / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / "config.json").write_text(json.dumps({"command": "bench", "controller": {"target_ms": 100}}))

    write(tmp_path / "x", [trial(1, "dlfp", 90, 95), trial(1, "dlfp:turn_first=false", 110, 99),
                           trial(1, "fixed:2", 50, 40)])
    write(tmp_path / "x-base", [trial(1, "dlfp", 100, 97)])
    lines = side_by_side(tmp_path / "x", {"controller": {"target_ms": 100}})
    text = "\n".join(lines)
    assert "(0.90x)" in text and "(1.10x)" in text and "fixed:2" not in text
    assert "this build's dlfp / baseline: mean 0.900" in text
    assert "this build's dlfp:turn_first=false / baseline: mean 1.100" in text
