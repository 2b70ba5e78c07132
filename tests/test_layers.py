"""Import arrows run one way between the layers:

    app (CLI, bench, server, assembly)  ->  adapters (backends/)  ->  core (dlfp/)
    app  ->  devices/, workloads/  ->  core

The core (the engine, scheduler, controller, their contract with adapters in
dlfp/protocol.py) imports no other layer. devices/ and workloads/ import only the
core (a command among them, `cli.py`, is the app's). Nothing under dlfp/ imports an adapter: the app reaches one by name through
the target registry (dlfp/targets.py) or a lazy command (dlfp/cli.py). Adapters
import the core, devices/ and workloads/; the few adapter files that are commands
or benchmarks themselves (`dlfp check-backend`, `check-model`, the GPU check, vLLM's
run target) are listed by name below and may import the app. Checked on every import
statement, at module level or inside a function."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = {"protocol", "sequence", "policy", "paper", "tail", "margin", "controller", "stepcost", "scheduler", "prefix_cache", "observer", "engine", "contention",
        "trace", "metrics", "sampling", "stats", "sim", "models"}
PACKAGES = {"dlfp.backends": "adapters", "dlfp.devices": "devices", "dlfp.workloads": "workloads"}
FOLDERS = {"backends": "adapters", "devices": "devices", "workloads": "workloads"}
MAY_IMPORT = {
    "core": {"core"},
    "devices": {"core", "devices"},
    "workloads": {"core", "workloads"},
    "adapters": {"core", "devices", "workloads", "adapters"},
    "app": {"core", "devices", "workloads", "app"},
}
ADAPTER_COMMANDS = {"backends/check_model.py", "backends/conformance.py", "backends/torch/gpu_check.py",
                    "backends/vllm/target.py", "backends/vllm/settings.py"}


def layer_of_module(module: str) -> str | None:
    for package, layer in PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return layer
    if module == "dlfp" or not module.startswith("dlfp."):
        return None
    return "core" if module.split(".")[1] in CORE else "app"


def layer_of_file(rel: Path) -> str:
    if rel.name == "cli.py":  # a command, wherever it lives (`dlfp probe` is devices/cli.py)
        return "app"
    if rel.parts[0] in FOLDERS:
        return FOLDERS[rel.parts[0]]
    return "core" if len(rel.parts) == 2 and rel.stem in CORE else "app"


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "dlfp" else [node.module]
            out += [(node.lineno, name) for name in names]
    return out


def offending(folder: str, root: Path | None = None) -> list[str]:
    root = root or ROOT
    bad = []
    for path in sorted((root / folder).rglob("*.py")):
        rel = path.relative_to(root)
        layer = layer_of_file(rel)
        allowed = MAY_IMPORT[layer] | ({"app"} if rel.as_posix() in ADAPTER_COMMANDS else set())
        for line, module in imports(path):
            target = layer_of_module(module)
            if target is not None and target not in allowed:
                bad.append(f"{rel}:{line} imports {module} ({layer} -> {target})")
    return bad


@pytest.mark.parametrize("folder", ["dlfp", "backends", "devices", "workloads"])
def test_imports_run_one_way(folder):
    assert offending(folder) == []


def test_the_check_sees_imports_inside_functions_and_the_core_reaching_an_adapter(tmp_path):
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "x.py").write_text("def f():\n    from dlfp.assembly import build_engine\n")
    (tmp_path / "dlfp").mkdir()
    (tmp_path / "dlfp" / "engine.py").write_text("import dlfp.backends.llamacpp\n")
    assert offending("devices", tmp_path) == ["devices/x.py:2 imports dlfp.assembly (devices -> app)"]
    assert offending("dlfp", tmp_path) == ["dlfp/engine.py:1 imports dlfp.backends.llamacpp (core -> adapters)"]


def test_every_adapter_command_exception_is_still_needed():
    for rel in ADAPTER_COMMANDS:
        app = [m for _, m in imports(ROOT / rel) if layer_of_module(m) == "app"]
        assert app, f"{rel} no longer imports the app: drop it from ADAPTER_COMMANDS"
