"""A model's real tokenizer, from a Hugging Face tokenizer folder written by an exporter.

The folder holds `tokenizer.json` (the fast tokenizer), `tokenizer_config.json`
and/or `chat_template.jinja` (the chat template), written from a GGUF by
`gguf_weights.write_tokenizer`, plus `dlfp-tokenizer.json`: the end-of-generation
ids llama.cpp uses for the same file. Loading needs only `tokenizers` and jinja2,
not transformers.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from dlfp.protocol import BackendError

DLFP_TOKENIZER = "dlfp-tokenizer.json"
# End-of-generation tokens llama.cpp also recognises by their text (llama-vocab.cpp), beyond
# the eos/eot/eom ids: turn ends, and the fill-in-the-middle pad/repo/file-separator tokens.
# Checked against llama.cpp's own set on SmolLM2 (tests/test_gguf_models.py).
EOG_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
             "<|endoftext|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|fim_pad|>", "<fim-pad>",
             "<|repo_name|>", "<fim-repo>", "<reponame>", "<|file_sep|>")


class HFTokenizer:
    def __init__(self, folder: str | Path, meta: dict | None = None):
        """`meta` (eog_ids, bos_id, add_bos) stands in for dlfp-tokenizer.json, e.g. from mlc-chat-config.json."""
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        tj = self.folder / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"no tokenizer.json in {self.folder}")
        self._tok = Tokenizer.from_file(str(tj))
        cfg_path = self.folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        meta_path = self.folder / DLFP_TOKENIZER
        self.meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        self.meta.update({k: v for k, v in (meta or {}).items() if k in ("eog_ids", "bos_id", "add_bos")})
        self.eos_ids = set(self.meta.get("eog_ids") or [])
        self._special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._special_ids = set(self._special.values())
        self._byte_level = _decoder_kind(json.loads(tj.read_text()).get("decoder")) == "ByteLevel"
        self._template_source = self._find_template()
        self._template = None

    def _find_template(self) -> str | None:
        jinja = self.folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        t = self.config.get("chat_template")
        return t if isinstance(t, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        # BOS by llama.cpp's rule for the same GGUF (dlfp-tokenizer.json), not tokenizer.json's
        # post-processor, which transformers leaves to its Python classes.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special and self.meta.get("add_bos"):
            ids = [self.meta["bos_id"], *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, ids: list[int], special: bool = False) -> bytes:
        """Raw bytes of each token (a UTF-8 character may span tokens), specials only if asked."""
        out = bytearray()
        for t in ids:
            if t in self._special_ids:
                if special:
                    out += self._tok.id_to_token(t).encode()
                continue
            piece = self._tok.id_to_token(t)
            if piece is None:
                continue
            out += _byte_level_bytes(piece) if self._byte_level else _sentencepiece_bytes(piece)
        return bytes(out)

    def is_eos(self, token_id: int) -> bool:
        return token_id in self.eos_ids

    def render_chat(self, messages: list[dict]) -> str:
        if self._template_source is None:
            raise BackendError(f"the tokenizer in {self.folder} has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # Templates come from model files: render them sandboxed, as transformers does.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self._template_source)
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=_token_text(self.config.get("bos_token")),
                                     eos_token=_token_text(self.config.get("eos_token")))

    def chat(self, messages: list[dict]) -> list[int]:
        # The template writes any BOS itself, as llama.cpp's chat path assumes.
        return self.encode(self.render_chat(messages), add_special=False)

    def describe(self) -> dict:
        return {"kind": "hf", "folder": str(self.folder), "vocab_size": self.vocab_size,
                "eog_ids": sorted(self.eos_ids)}


def write_eog(folder: str | Path, eog_ids: list[int], source: str, bos_id: int | None = None,
              add_bos: bool = False) -> None:
    """What llama.cpp decides from the GGUF and tokenizer.json does not carry: EOG ids, BOS rule."""
    meta = {"eog_ids": sorted(set(eog_ids)), "bos_id": bos_id, "add_bos": bool(add_bos and bos_id is not None),
            "source": source}
    (Path(folder) / DLFP_TOKENIZER).write_text(json.dumps(meta, indent=2))


def _raise(message: str):
    raise BackendError(f"chat template: {message}")


def _token_text(value) -> str:
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


def _decoder_kind(decoder: dict | None) -> str | None:
    if not decoder:
        return None
    if decoder.get("type") == "Sequence":
        kinds = {d.get("type") for d in decoder.get("decoders", [])}
        return "ByteLevel" if "ByteLevel" in kinds else "Sequence"
    return decoder.get("type")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character table (byte-level BPE pieces)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _byte_level_bytes(piece: str) -> bytes:
    table = _unicode_to_byte()
    return bytes(table[c] for c in piece if c in table)


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])  # byte-fallback token
    return piece.replace("\u2581", " ").encode("utf-8")
