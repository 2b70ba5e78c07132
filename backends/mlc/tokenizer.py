"""Byte-level tokenizer and chat template for models in the dlfp MLC folder format.

Ids 0-255 are the bytes of the UTF-8 text; special tokens (ChatML markers) follow.
It is an honest tokenizer for a tiny test model: every text round-trips, and the
prompt length in tokens is its length in bytes.
"""
from __future__ import annotations

import re

from dlfp.protocol import BackendError

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257, "<|endoftext|>": 258}
CHATML_EOS = ["<|im_end|>", "<|endoftext|>"]


class ByteTokenizer:
    def __init__(self, special_tokens: dict[str, int], eos_tokens: list[str], chat_template: str | None):
        if any(i < 256 for i in special_tokens.values()):
            raise ValueError("special token ids must be >= 256 (0-255 are bytes)")
        unknown = [t for t in eos_tokens if t not in special_tokens]
        if unknown:
            raise ValueError(f"eos tokens {unknown} are not special tokens")
        self.special = dict(special_tokens)
        self.by_id = {i: t for t, i in special_tokens.items()}
        self.eos_ids = {special_tokens[t] for t in eos_tokens}
        self._split = re.compile("(" + "|".join(map(re.escape, special_tokens)) + ")") if special_tokens else None
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_config(cls, cfg: dict) -> "ByteTokenizer":
        if cfg.get("kind") != "bytes":
            raise ValueError(f"unsupported tokenizer kind {cfg.get('kind')!r} (this format has 'bytes')")
        return cls(cfg["special_tokens"], cfg["eos_tokens"], cfg.get("chat_template"))

    @staticmethod
    def chatml_config() -> dict:
        return {
            "kind": "bytes",
            "special_tokens": CHATML_SPECIALS,
            "eos_tokens": CHATML_EOS,
            "chat_template": CHATML_TEMPLATE,
        }

    @property
    def size(self) -> int:
        return max([255, *self.by_id]) + 1

    def encode(self, text: str, add_special: bool = True) -> list[int]:  # no BOS to add
        parts = self._split.split(text) if self._split else [text]
        out: list[int] = []
        for part in parts:
            if part in self.special:
                out.append(self.special[part])
            else:
                out.extend(part.encode("utf-8"))
        return out

    def decode_bytes(self, ids: list[int], special: bool = False) -> bytes:
        out = bytearray()
        for t in ids:
            if t < 256:
                out.append(t)
            elif special and t in self.by_id:
                out += self.by_id[t].encode()
        return bytes(out)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, ids: list[int], special: bool = False) -> bytes:
        return self.decode_bytes(ids, special)

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_ids

    def chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))

    def render_chat(self, messages: list[dict]) -> str:
        if self._template is None:
            raise BackendError("the model folder has no chat template")
        return self._template.render(messages=messages, add_generation_prompt=True)


def _compile(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # Templates come from model folders: render them sandboxed, as transformers does.
    return ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False).from_string(source)


def load_tokenizer(cfg: dict, folder):
    """A model folder's tokenizer: bytes (tiny test models) or a Hugging Face folder inside it."""
    if cfg.get("kind") == "hf":
        from dlfp.backends.hf_tokenizer import HFTokenizer

        return HFTokenizer(folder / cfg["folder"], meta=cfg)
    return ByteTokenizer.from_config(cfg)
