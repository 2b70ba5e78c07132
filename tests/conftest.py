import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_gguf import CHATML, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random-weight llama GGUF with a ChatML template (for llama.cpp tests)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", vocab=512, chat_template=CHATML)
