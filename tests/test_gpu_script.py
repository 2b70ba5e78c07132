"""scripts/gpu_torch_check.sh as the GPU machine runs it, and the check's files and verdict.

The GPU machine runs a command on a copy of the tracked and untracked-not-ignored
files (no .venv), with its own python3 where nothing of this project is installed.
The end-to-end test does the same on the CPU: a copy of the file list in a temporary
folder, run from its root (so a `dlfp/` folder is the working directory's), and a
fresh virtual environment that sees torch, numpy and torch's own dependencies and
nothing else (no dlfp, no editable finder, no click, rich, scipy or psutil).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the GPU script's CPU run needs torch (scripts/setup.d/executorch.sh installs it)")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "scripts/gpu_torch_check.sh"
MODES, ARMS = ("async", "sync"), ("unbounded", "dlfp-cadence", "dlfp-paper", "dlfp")
NOT_THERE = ("dlfp", "click", "rich", "scipy", "psutil")


def _closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `names` need, theirs included (extras left out)."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform dependency this machine does not have
        found[key] = dist
        todo += [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in dist.requires or [] if "extra ==" not in r]
    return list(found.values())


@pytest.fixture(scope="module")
def torch_only_python(tmp_path_factory) -> Path:
    """A fresh venv whose one .pth names a folder of links to torch, numpy and their dependencies."""
    root = tmp_path_factory.mktemp("torch-only")
    site = root / "site"
    site.mkdir()
    for dist in _closure(["torch", "numpy"]):
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "torch_only.pth").write_text(f"{site}\n")
    probe = "import importlib.util as u, torch, numpy; print([m for m in %r if u.find_spec(m)])" % (NOT_THERE,)
    seen = subprocess.run([str(py), "-c", probe], cwd=root, capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr[-2000:]
    assert seen.stdout.strip() == "[]", f"the device-like python has more than torch and numpy: {seen.stdout}"
    return py


def _device_copy(dest: Path) -> Path:
    """The tracked and untracked-not-ignored files, as they are on disk now."""
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the device's copy is git's file list, and git cannot list this tree: {exc}")
    for rel in filter(None, listed.decode().split("\0")):
        src = REPO / rel
        if src.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def test_the_script_runs_as_the_device_runs_it(tmp_path, torch_only_python):
    tree = _device_copy(tmp_path / "tree")
    out = tmp_path / "out"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8", "OUT": str(out),
           "PY": str(torch_only_python), "REQUESTS": "4"}
    proc = subprocess.run(["bash", SCRIPT, "--tiny"], cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]

    # At most 6 files, whatever the number of arms: the machine brings back 8.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "trials.jsonl", "table.md", "models.json", "traces.tar.gz", "run.log"])
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["policy"]) for r in rows] == [(m, a) for m in MODES for a in ARMS]
    assert all(r["completed"] == r["submitted"] == 4 for r in rows)
    with tarfile.open(out / "traces.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{kind}-tiny-{m}-801-{a}.jsonl" for kind in ("steps", "requests") for m in MODES for a in ARMS} <= names
    table = (out / "table.md").read_text()
    assert "| tiny | async | dlfp-paper |" in table and "| tiny | async | dlfp-cadence |" in table
    assert table in (out / "run.log").read_text()
    assert proc.stdout.count("estimated") == len(MODES) * len(ARMS)  # each arm's estimate, before it runs

    (model,) = json.loads((out / "models.json").read_text())
    assert model["pipeline_check"]["identical"]
    assert model["decode_position"] >= round(16384 * 0.1)  # the workload's positions, not 0-8
    assert model["target_ms"] == model["auto_target_ms"] > model["decode_step_ms"]
    config = json.loads((out / "config.json").read_text())
    assert config["gpu_check"]["models"] == "tiny" and {"git", "versions", "machine"} <= set(config)


# -- in-process: the files after every arm, the verdict ------------------------------

def _args(out: Path, arms: str) -> list[str]:
    # Only options the check has always had: these tests ran on the code before it changed.
    return ["--models", "tiny", "--modes", "sync", "--arms", arms, "--device", "cpu", "--dtype", "float32",
            "--threads", "1", "--requests", "2", "--rate", "4", "--scale", "0.02",
            "--profile", str(REPO / "backends/torch/profiles/cpu-tiny-agent.toml"), "--out", str(out)]


def test_the_files_are_current_after_every_arm(tmp_path, monkeypatch):
    """A run cut at its time limit (killed: no cleanup runs) keeps every arm it finished."""
    from dlfp.backends.torch import gpu_check

    out = tmp_path / "out"
    real, done = gpu_check.run_trial, []

    def spy(arm, schedule, order=0, *a, **kw):
        if done:  # what a kill at this moment would leave
            table = (out / "table.md").read_text()
            assert [f"| tiny | sync | {p} |" in table for p in done] == [True] * len(done)
            assert len((out / "trials.jsonl").read_text().splitlines()) == len(done)
            with tarfile.open(out / "traces.tar.gz") as tar:
                assert len(tar.getnames()) == 2 * len(done)
        done.append(arm.policy)
        return real(arm, schedule, order, *a, **kw)

    monkeypatch.setattr(gpu_check, "run_trial", spy)
    assert gpu_check.main(_args(out, "unbounded,dlfp,dlfp-cadence")) == 0
    assert done == ["unbounded", "dlfp", "dlfp-cadence"]


def test_the_exit_status_names_every_failure(tmp_path, monkeypatch, capsys):
    from dlfp.backends.torch import gpu_check
    from dlfp.protocol import BackendError

    real = gpu_check.run_trial

    def failing(arm, schedule, order=0, *a, **kw):
        if arm.policy != "dlfp":
            return real(arm, schedule, order, *a, **kw)
        backend = arm.target.backend

        def refuse(plan):
            raise BackendError("injected step failure")

        backend.launch = refuse  # every step of this arm fails: its requests end in errors
        try:
            return real(arm, schedule, order, *a, **kw)
        finally:
            del backend.launch

    def agreement(runs, baseline):
        return {r.arm: {"compared": 3, "mismatches": ["agent-1"] if r.arm == "dlfp-cadence" else [],
                        "unverifiable": 0} for r in runs if r.arm != baseline}

    monkeypatch.setattr(gpu_check, "run_trial", failing)
    monkeypatch.setattr(gpu_check, "output_agreement", agreement)
    monkeypatch.setattr(gpu_check, "pipeline_check", lambda backend: {"identical": False, "tokens": 18})
    assert gpu_check.main(_args(tmp_path / "out", "unbounded,dlfp-cadence,dlfp")) == 1
    printed = capsys.readouterr().out
    assert "FAILED: tiny sync dlfp: 0/2 requests completed (injected step failure)" in printed
    assert "FAILED: tiny sync dlfp-cadence: greedy tokens of 1 of 3 requests differ from unbounded (agent-1)" in printed
    assert "FAILED: tiny: launched ahead, the greedy tokens differ" in printed
    assert "FAILED: tiny sync unbounded" not in printed


def test_calibration_runs_at_the_positions_the_workload_reaches():
    from dlfp.backends.torch.backend import TorchBackend
    from dlfp.backends.torch.config import ModelConfig
    from dlfp.backends.torch.gpu_check import calibrate, workload_positions
    from dlfp.workloads.schedule import build_schedule
    from dlfp.workloads.specs import get_spec

    agent = build_schedule(get_spec("agent").with_load(2, 1.0), 801, 151936)
    assert workload_positions(agent, 16704, 8192) == (16384 + 128, 4096)  # mid-output; a chunk over mid-prompt
    b = TorchBackend(ModelConfig.load("tiny"), None, n_seq=3, n_ctx=512, n_batch=64, device="cpu", dtype="float32",
                     n_threads=1)
    plans, step = [], b.step
    b.step = lambda plan: (plans.append(plan), step(plan))[1]
    cal = calibrate(b, 300, 100, repeats=2)
    timed = plans[-6:]  # after filling every slot: 3 decode-only steps, then 3 beside a 63-token chunk
    assert all(d.position == 300 for p in timed for d in p.decodes)
    assert [len(p.decodes) for p in timed] == [3, 3, 3, 1, 1, 1]
    assert [(c.start, len(c.token_ids)) for p in timed[3:] for c in p.prefills] == [(100, 63)] * 3
    assert cal["decode_position"] == 300 and cal["full_step_ms"] > cal["decode_step_ms"] > 0
