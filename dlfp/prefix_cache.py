"""Which sequence slot a new request gets, and what its cache already holds.

A finished request's tokens stay in its slot (the backend keeps their KV), so a
chat's next turn, whose prompt starts with the previous prompt and reply, needs to
prefill only what is new. Choosing a slot for a request:

1. the free slot whose cached tokens share the longest prefix with the prompt;
   ties go to the least recently used slot (an empty slot counts as least recent);
2. a background request does not take a slot whose tokens came from a foreground
   request (a live conversation) while another free slot can serve it.

The slot keeps the common prefix and drops the rest; at least one prompt token is
always left to prefill, since the first output token needs the last prompt
token's logits. Pure bookkeeping: the engine tells the backend what to drop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dlfp.sequence import FOREGROUND


@dataclass
class SlotState:
    slot: int
    tokens: list[int] = field(default_factory=list)  # whose KV the slot holds, positions 0..n-1
    priority: str | None = None  # class of the request that left them (None: empty)
    last_used: int = -1  # use counter at the last admission or release (-1: never)
    busy: bool = False


@dataclass(frozen=True)
class Grant:
    slot: int
    reused: int  # prompt tokens whose KV the slot already holds (0: start from an empty cache)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Slot pool with prefix reuse; `enabled=False` keeps no tokens (a plain free list)."""

    def __init__(self, n_slots: int, enabled: bool = True):
        self.enabled = enabled
        self.slots = [SlotState(i) for i in range(n_slots)]
        self._clock = 0

    def free(self) -> list[int]:
        return [s.slot for s in self.slots if not s.busy]

    def n_free(self) -> int:
        return sum(1 for s in self.slots if not s.busy)

    def acquire(self, prompt: list[int], priority: str, reuse: bool = True) -> Grant:
        """Take the best free slot for `prompt` (raises LookupError when none is free)."""
        free = [s for s in self.slots if not s.busy]
        if not free:
            raise LookupError("no free sequence slot")
        if priority != FOREGROUND:
            spare = [s for s in free if s.priority != FOREGROUND]
            free = spare or free  # a conversation's slot only when nothing else can serve
        use = self.enabled and reuse
        lcp = {s.slot: common_prefix(s.tokens, prompt) if use else 0 for s in free}
        best = max(free, key=lambda s: (lcp[s.slot], -s.last_used))
        reused = min(lcp[best.slot], len(prompt) - 1)  # leave a token to prefill for the first logits
        best.busy = True
        best.tokens = list(prompt[:reused]) if use else []
        best.priority = priority
        best.last_used = self._tick()
        return Grant(best.slot, max(reused, 0))

    def release(self, slot: int, tokens: list[int] | None) -> None:
        """The slot's request ended; `tokens` are those whose KV the slot now holds
        (None: the cache is not trusted, e.g. a failed step, and counts as empty)."""
        s = self.slots[slot]
        s.busy = False
        s.last_used = self._tick()
        if tokens is None or not self.enabled:
            s.tokens, s.priority = [], None
        else:
            s.tokens = list(tokens)

    def holds(self, slot: int) -> bool:
        """Whether the slot keeps its tokens for reuse (the engine leaves its cache alone)."""
        return bool(self.slots[slot].tokens)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
