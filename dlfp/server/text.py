"""Token ids to streamed text: whole UTF-8 characters only, stop strings cut out."""
from __future__ import annotations

import codecs

from dlfp.protocol import Backend


class TextStream:
    """Turns one request's tokens into text deltas as they arrive.

    A token may end in the middle of a multi-byte character (byte-fallback
    vocabularies do this for most non-Latin text): its bytes wait in an
    incremental decoder until the character is whole. Text that could be the
    start of a stop string is held back until it is known not to be one.
    """

    def __init__(self, backend: Backend, stop: list[str] | None = None):
        self._backend = backend
        self._bytewise = backend.token_bytes([]) is not None  # the tokenizer has byte pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # only for backends without token_bytes
        self._decoded = ""
        self.stop = [s for s in (stop or []) if s]
        self._held = ""
        self.stopped = False  # a stop string was found: the request should end

    def push(self, token_id: int) -> str:
        """The text this token completes ('' while a character or a possible stop is pending)."""
        if self.stopped:
            return ""
        return self._release(self._held + self._decode(token_id))

    def flush(self) -> str:
        """Whatever is still held once the request has ended."""
        if self.stopped:
            return ""
        tail = self._held + (self._decoder.decode(b"", final=True) if self._bytewise else "")
        self._held = ""
        return tail

    def _decode(self, token_id: int) -> str:
        if self._bytewise:
            return self._decoder.decode(self._backend.token_bytes([token_id]))
        # Generic backends: decode everything so far and hand out the new suffix.
        self._ids.append(token_id)
        full = self._backend.detokenize(self._ids)
        if full.endswith("\ufffd"):
            return ""  # probably a character cut in two: wait for the next token
        new, self._decoded = full[len(self._decoded):], full
        return new

    def _release(self, pending: str) -> str:
        if not self.stop:
            return pending
        hits = [i for s in self.stop if (i := pending.find(s)) >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return pending[: min(hits)]
        keep = _longest_stop_prefix_suffix(pending, self.stop)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep]


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
