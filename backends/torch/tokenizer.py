"""Text handling: the model folder's own tokenizer through transformers, or a byte-level stand-in.

The stand-in serves bundled configs with random weights (no tokenizer exists):
byte b is token b + 3 (0, 1, 2 are left to pad/bos/eos), so any text round-trips.
Its text is meaningless with random weights; timing and control are what count.
"""
from __future__ import annotations

from pathlib import Path

from dlfp.protocol import BackendError

BYTE_OFFSET = 3


class ByteTokenizer:
    kind = "byte-level stand-in"

    def __init__(self, vocab_size: int):
        if vocab_size < 256 + BYTE_OFFSET:
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of >= {256 + BYTE_OFFSET}, got {vocab_size}")

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET).decode("utf-8", "replace")

    def chat(self, messages: list[dict]) -> list[int]:
        raise BackendError("the byte-level stand-in tokenizer has no chat template (the model folder has no tokenizer)")


class HFTokenizer:
    kind = "transformers"

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise BackendError("the model's tokenizer has no chat template")
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def load_tokenizer(folder: Path | None, vocab_size: int):
    """The folder's tokenizer when it has one (tokenizer.json or tokenizer_config.json), else bytes."""
    if folder is not None and folder.is_dir() and any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json")):
        return HFTokenizer(folder)
    return ByteTokenizer(vocab_size)
