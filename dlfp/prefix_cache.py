"""Which sequence slot a new request gets, and what its cache already holds.

A finished request's tokens stay in its slot (the backend keeps their KV), so a
chat's next turn, whose prompt starts with the previous prompt and reply, needs to
prefill only what is new. A free slot's content is one of:

- empty (never used, or its cache was dropped);
- background: left by a background request, or by a conversation idle for longer
  than the hold time (`hold_s`), i.e. nothing anyone is likely to ask for again;
- a live conversation: left by a foreground request within the hold time.

Choosing a slot for a foreground request:

1. a slot the prompt continues (the common prefix covers at least half of the
   slot's cached tokens, as llama.cpp's server's slot similarity): the longest
   common prefix wins, ties go to the least recently used slot;
2. otherwise a slot to evict, in order: empty, background, then the least recently
   used live conversation.

Background requests hold at most the slots the conversations leave: the slot
count less the conversations (foreground requests running, and free slots holding
a live conversation), and at least one, so background work always progresses. A
background request never evicts a live conversation while another free slot can
serve it (empty or background); it waits instead. A live conversation's slot is
given up to background work only when it is the only kind of free slot and no
background request holds any slot (the longest-idle conversation pays).

A conversation that needs a slot while background requests hold more than their
share takes one of theirs instead of another conversation's prefix: the scheduler
preempts a background request still loading its prompt (it resumes later from its
first token, as vLLM preempts by recompute). Under a prefill cap a background
prompt advances slowly; were conversations to share what documents leave, each new
turn would evict another conversation's prefix and re-prefill its whole history
under the cap, slowing the documents further (a circle an uncapped runtime never
enters, its documents leave quickly). Every eviction is counted by reason
(`evictions`).

The slot keeps the common prefix and drops the rest; at least one prompt token is
always left to prefill, since the first output token needs the last prompt
token's logits. Pure bookkeeping: the engine tells the backend what to drop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dlfp.sequence import FOREGROUND

# Why a slot's content was dropped for another request (PrefixCache.evictions).
EVICT_CONVERSATION_FOR_FOREGROUND = "conversation_for_foreground"  # another conversation's new turn
EVICT_CONVERSATION_FOR_BACKGROUND = "conversation_for_background"  # background work had no other slot
PREEMPT_BACKGROUND = "background_preempted"  # a loading background request gave its slot to a conversation
EVICTION_REASONS = (EVICT_CONVERSATION_FOR_FOREGROUND, EVICT_CONVERSATION_FOR_BACKGROUND, PREEMPT_BACKGROUND)

DEFAULT_HOLD_S = 120.0  # a chat's think time between turns is well under this; a closed chat's slot returns after it


@dataclass
class SlotState:
    slot: int
    tokens: list[int] = field(default_factory=list)  # whose KV the slot holds, positions 0..n-1
    priority: str | None = None  # class of the request that left them (None: empty)
    last_used: int = -1  # use counter at the last admission or release (-1: never)
    last_used_s: float = float("-inf")  # clock time of the last admission or release
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
    """Slot pool with prefix reuse; `enabled=False` keeps no tokens (a plain free list).

    `hold_s`: how long after its last use a conversation's slot is protected from
    background requests (None: for ever, still subject to the progress rule above).
    """

    def __init__(self, n_slots: int, enabled: bool = True, hold_s: float | None = DEFAULT_HOLD_S):
        if hold_s is not None and hold_s < 0:
            raise ValueError(f"prefix hold time must be >= 0 s, got {hold_s}")
        self.enabled = enabled
        self.hold_s = hold_s
        self.slots = [SlotState(i) for i in range(n_slots)]
        self._clock = 0
        self.evictions: dict[str, int] = {}  # reason -> count

    def free(self) -> list[int]:
        return [s.slot for s in self.slots if not s.busy]

    def n_free(self) -> int:
        return sum(1 for s in self.slots if not s.busy)

    def live(self, s: SlotState, now: float) -> bool:
        """Whether a free slot holds a live conversation's prefix."""
        if not (self.enabled and s.tokens and s.priority == FOREGROUND):
            return False
        return self.hold_s is None or now - s.last_used_s <= self.hold_s

    def conversations(self, now: float) -> int:
        """Foreground requests holding a slot, and free slots holding a live conversation."""
        return sum(1 for s in self.slots if (s.busy and s.priority == FOREGROUND) or (not s.busy and self.live(s, now)))

    def background_share(self, now: float, arriving: int = 0) -> int:
        """Slots background requests may hold: what the conversations (and `arriving` ones
        not yet in a slot) leave, at least one."""
        if not self.enabled:
            return len(self.slots)
        return max(1, len(self.slots) - self.conversations(now) - arriving)

    def background_held(self) -> int:
        return sum(1 for s in self.slots if s.busy and s.priority != FOREGROUND)

    def needs_room(self, prompt: list[int], now: float) -> bool:
        """A foreground prompt would have to evict a live conversation (or wait for a slot):
        no free slot is empty, background, or one this prompt continues."""
        free = [s for s in self.slots if not s.busy]
        return not any(not self.live(s, now) or self._continues(s, common_prefix(s.tokens, prompt)) for s in free)

    def count(self, reason: str) -> None:
        self.evictions[reason] = self.evictions.get(reason, 0) + 1

    def usable_by_background(self, now: float) -> list[SlotState]:
        """Free slots a background request may take now (see the module docstring)."""
        if self.background_held() >= self.background_share(now):
            return []
        free = [s for s in self.slots if not s.busy]
        spare = [s for s in free if not self.live(s, now)]
        if spare or any(s.busy and s.priority != FOREGROUND for s in self.slots):
            return spare
        return sorted(free, key=lambda s: s.last_used)[:1]  # background must progress: the longest idle

    def acquire(self, prompt: list[int], priority: str, reuse: bool = True, now: float = 0.0) -> Grant | None:
        """Take the best free slot for `prompt`; None when no slot may serve it
        (none free, or, for background, only live conversations' slots)."""
        use = self.enabled and reuse
        if priority == FOREGROUND:
            free = [s for s in self.slots if not s.busy]
        else:
            free = self.usable_by_background(now)
        if not free:
            return None
        lcp = {s.slot: common_prefix(s.tokens, prompt) if use else 0 for s in free}
        best = self._choose(free, lcp, priority, now)
        if self.live(best, now) and not self._continues(best, lcp[best.slot]):
            self.count(EVICT_CONVERSATION_FOR_FOREGROUND if priority == FOREGROUND else EVICT_CONVERSATION_FOR_BACKGROUND)
        reused = min(lcp[best.slot], len(prompt) - 1)  # leave a token to prefill for the first logits
        best.busy = True
        best.tokens = list(prompt[:reused]) if use else []
        best.priority = priority
        best.last_used, best.last_used_s = self._tick(), now
        return Grant(best.slot, max(reused, 0))

    @staticmethod
    def _continues(s: SlotState, lcp: int) -> bool:
        """The prompt continues the slot's content: their common prefix covers at least half of it."""
        return lcp > 0 and 2 * lcp >= len(s.tokens)

    def _choose(self, free: list[SlotState], lcp: dict[int, int], priority: str, now: float) -> SlotState:
        continues = [s for s in free if self._continues(s, lcp[s.slot])]
        if continues:
            return max(continues, key=lambda s: (lcp[s.slot], -s.last_used))
        if priority != FOREGROUND:  # every slot offered is one background may take
            return max(free, key=lambda s: (lcp[s.slot], -s.last_used))

        def order(s: SlotState) -> tuple:  # empty, background (longest prefix first), then the LRU conversation
            if self.live(s, now):
                return (2, 0, s.last_used)
            return (1 if s.tokens else 0, -lcp[s.slot], s.last_used)

        return min(free, key=order)

    def release(self, slot: int, tokens: list[int] | None, now: float = 0.0) -> None:
        """The slot's request ended; `tokens` are those whose KV the slot now holds
        (None: the cache is not trusted, e.g. a failed step, and counts as empty)."""
        s = self.slots[slot]
        s.busy = False
        s.last_used, s.last_used_s = self._tick(), now
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
