import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_gguf import CHATML, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random-weight llama GGUF with a ChatML template (for llama.cpp tests)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", vocab=512, chat_template=CHATML)


@pytest.fixture(scope="session", autouse=True)
def state_dir(tmp_path_factory) -> Path:
    """`dlfp serve` started by a test keeps its Batch API state in a temporary folder, not the
    user's data folder (DLFP_STATE_DIR; a test that passes --state-dir uses its own)."""
    folder = tmp_path_factory.mktemp("dlfp-state")
    os.environ.setdefault("DLFP_STATE_DIR", str(folder))
    return Path(os.environ["DLFP_STATE_DIR"])
