"""Foreground/background step planning.

Each step, in order:
1. decode: every decoding sequence gets its next token (all classes);
2. prefill: foreground prompts before background prompts, FIFO within a class.

How many prompt tokens join:
- guarded step (a protected sequence decodes): at most the policy's cap, shared by
  all prompts of the step. The policy plans for every decode of the step, against the
  tightest ITL target among the streaming chats (a request's own `itl_target_s`, else
  the policy's; a reply that has had the ITLs over it that its own P99 absorbs counts at
  target / the policy's `spent_factor`). A cap of 0 (not even one prompt token fits) keeps every background
  prompt and decode out. Under a policy that plans new turns (`dlfp`), while a
  foreground prompt (a new turn) loads, the streaming chats' targets come first and
  the new turn second: background prompts and decodes wait, the policy plans for the protected decodes alone, and the turn's chunk is the
  largest that meets the target; where not even its minimum chunk fits, it waits for
  a stream to end (a step that carried it would break every streaming chat's target,
  failing each of their goals to serve one). Foreground prompts load earliest
  deadline first (arrival plus the request's `ttft_goal_s`, else the default goal);
- foreground prompt with no protected decode beside it: full batches;
- background prompt with no protected decode beside it: at most the preemption
  budget's token count, so a foreground message that arrives meanwhile waits at
  most about one budget (None: no budget, as llama.cpp's server does). Background
  prompts wait while a foreground prompt is loading.

Prefix reuse (backends that declare `prefix_reuse`): a finished sequence's tokens
stay in its slot, and a new sequence is admitted to the slot sharing the longest
prompt prefix (`dlfp.prefix_cache`); it starts with those tokens already prefilled,
so the cap and the preemption budget apply to the rest exactly as to any prompt.
A background request does not evict a live conversation's slot (one used within
`prefix_hold_s`) while an empty or background slot can serve; it waits instead.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from dlfp.protocol import PLACEHOLDER_TOKEN, Capabilities, DecodeItem, PrefillChunk, StepPlan
from dlfp.prefix_cache import DEFAULT_HOLD_S, PREEMPT_BACKGROUND, PrefixCache
from dlfp.sequence import BACKGROUND, FOREGROUND, FinishReason, Sequence, Status
from dlfp.trace import is_capped

# A foreground request's time-to-first-token goal where it names none: the laptop
# workload's TTFT SLO. It orders waiting prompts (earliest deadline first).
DEFAULT_TTFT_GOAL_S = 5.0


@dataclass
class PlannedStep:
    plan: StepPlan
    guarded: bool  # a protected sequence decodes in this step
    cap: int | None  # the cap in force (guarded steps only)
    bg_cap: int | None  # the preemption-budget cap in force (isolated background prefill)
    n_prefill_fg: int
    n_prefill_bg: int
    seqs: dict[int, Sequence] = field(default_factory=dict)  # slot -> the sequence it held when planned
    n_decode_held: int = 0  # background decodes a guarded step's cap kept waiting
    n_decode_protected: int = 0  # decodes of protected sequences: the foreground ITLs this step ends

    @property
    def capped(self) -> bool:
        return is_capped(self.guarded, self.cap, self.plan.n_prefill)

    def sampled_slots(self) -> list[int]:
        """Slots that get a token from this step: every decode, and prompts that complete."""
        return [d.seq_id for d in self.plan.decodes] + [c.seq_id for c in self.plan.prefills if c.wants_logits]


@dataclass
class StepUpdate:
    """What one step did to its sequences (the engine turns it into events)."""

    tokens: list[tuple[Sequence, int]] = field(default_factory=list)  # tokens appended, in step order
    finished: list[Sequence] = field(default_factory=list)  # ended by this step (stop or length)


class Scheduler:
    def __init__(
        self,
        caps: Capabilities,
        protect: tuple[str, ...] = (FOREGROUND,),
        is_eos: Callable[[int], bool] = lambda token: False,
        prefix_reuse: bool = False,
        prefix_hold_s: float | None = DEFAULT_HOLD_S,
        ttft_goal_s: float = DEFAULT_TTFT_GOAL_S,
    ):
        self.caps = caps
        self.ttft_goal_s = ttft_goal_s  # the deadline of a foreground prompt that names no goal
        self.is_eos = is_eos
        self.protect = protect  # classes whose decodes the cap guards
        self.waiting: dict[str, deque[Sequence]] = {FOREGROUND: deque(), BACKGROUND: deque()}
        self.running: list[Sequence] = []  # holds a slot, in admission order
        # Slots and what their caches hold; reuse only where the backend can drop a cache's tail.
        self.cache = PrefixCache(caps.max_sequences, enabled=prefix_reuse and caps.prefix_reuse,
                                 hold_s=prefix_hold_s)
        self.fg_reserved_slots = 1 if caps.max_sequences > 1 else 0
        self._turn = 0  # time-slicing position for single-sequence backends
        self._on_device: dict[int, int] = {}  # slot -> launched steps not yet back (pipelined engines)

    @property
    def free_slots(self) -> list[int]:
        return self.cache.free()

    # -- queue -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting[seq.priority].append(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting[FOREGROUND] or self.waiting[BACKGROUND])

    def admit(self, now: float = 0.0) -> list[Sequence]:
        """Give free slots to waiting sequences, foreground first.

        While no foreground sequence holds a slot, background work leaves one free:
        a chat message that arrives behind a folder of documents must not wait for
        one of them to finish. An admitted sequence's `n_cached` prompt tokens are
        already in its slot's cache; the caller drops the rest of that cache.
        A background sequence that only live conversations' slots could serve
        stays queued (`dlfp.prefix_cache`); `now` is the clock that ages them.
        """
        admitted = []
        for cls in (FOREGROUND, BACKGROUND):
            while self.waiting[cls]:
                seq = self.waiting[cls][0]
                if cls == FOREGROUND:
                    self._make_room(seq, now)
                if self.cache.n_free() <= self._reserve(cls):
                    break
                grant = self.cache.acquire(seq.request.prompt_ids, seq.priority, seq.request.cache_prompt, now)
                if grant is None:
                    break
                self.waiting[cls].popleft()
                seq.slot, seq.n_cached, seq.n_prefilled = grant.slot, grant.reused, grant.reused
                seq.status = Status.PREFILLING
                self.running.append(seq)
                admitted.append(seq)
        return admitted

    def _make_room(self, seq: Sequence, now: float) -> None:
        """A conversation that would evict another's prefix (or wait for a slot) takes a
        background request's slot instead, while background holds more than its share
        (`dlfp.prefix_cache`): the loading background request with the fewest prompt tokens
        done (the least work lost) goes back to the head of its queue, to start over."""
        cache = self.cache
        if not cache.enabled or not cache.needs_room(seq.request.prompt_ids, now):
            return
        if cache.background_held() <= cache.background_share(now, arriving=1):
            return
        loading = [s for s in self.running if s.priority != FOREGROUND and s.status == Status.PREFILLING
                   and not self._on_device.get(s.slot)]
        if not loading:
            return
        victim = min(loading, key=lambda s: (s.n_prefilled - s.n_cached, -self.running.index(s)))
        self.running.remove(victim)
        cache.release(victim.slot, None, now)  # its partial prompt is dropped with the slot
        cache.count(PREEMPT_BACKGROUND)
        victim.slot, victim.status, victim.n_prefilled, victim.n_cached = None, Status.WAITING, 0, 0
        victim.preemptions += 1
        self.waiting[victim.priority].appendleft(victim)

    def _reserve(self, cls: str) -> int:
        if cls == FOREGROUND or any(s.priority == FOREGROUND for s in self.running):
            return 0
        return self.fg_reserved_slots

    def forget_prefix(self, seq: Sequence) -> None:
        """The backend could not keep the granted prefix: the sequence starts from an empty cache."""
        seq.n_cached = seq.n_prefilled = 0

    def keeps_cache(self, slot: int) -> bool:
        """Whether a free slot's cache is kept for reuse (the caller must not free it)."""
        return self.cache.holds(slot)

    def finish(self, seq: Sequence, reason: FinishReason, now: float, error: str | None = None) -> bool:
        """End a sequence; its slot goes back to the pool. False if it had already ended.

        Returns True; the caller frees the backend's cache for `seq.slot` if the
        sequence held one (`seq.slot is not None` and it was running) and the pool
        does not keep it (`keeps_cache`). After an error the cache is not trusted.
        """
        if seq.status == Status.FINISHED:
            return False
        if seq in self.running:
            self.running.remove(seq)
            self.cache.release(seq.slot, None if reason == FinishReason.ERROR else _cached_tokens(seq), now)
            if reason == FinishReason.ERROR:  # a failed step never comes back to `update`
                self._on_device.pop(seq.slot, None)
        else:
            self.waiting[seq.priority] = deque(s for s in self.waiting[seq.priority] if s is not seq)
            seq.slot = None
        seq.status = Status.FINISHED
        seq.finish_reason, seq.error, seq.finished_s = reason, error, now
        return True

    # -- after a step ------------------------------------------------------
    def launched(self, step: "PlannedStep") -> None:
        """The step is on its way to the device: its prompts advance now, and each slot it
        samples has one more token in flight, so the next plan can follow it before it is
        back (a pipelined engine; a synchronous one calls `update` right after)."""
        for slot in _slots(step):
            self._on_device[slot] = self._on_device.get(slot, 0) + 1
        for chunk in step.plan.prefills:
            seq = step.seqs.get(chunk.seq_id)
            if seq is not None and seq.status != Status.FINISHED:
                seq.n_prefilled = chunk.end
        for slot in step.sampled_slots():
            seq = step.seqs.get(slot)
            if seq is not None and seq.status != Status.FINISHED:
                seq.in_flight += 1
                seq.status = Status.DECODING

    def update(self, step: "PlannedStep", tokens: dict[int, int], now: float) -> StepUpdate:
        """Apply a completed step: advance prompts, append sampled tokens, end what is done.

        `tokens` maps slot -> sampled token for the slots that got one (a slot whose
        sampling failed is absent; the engine has already ended it). Sequences are the
        ones the step was planned for: a slot freed and reused meanwhile is not touched.
        """
        by_slot = step.seqs or {s.slot: s for s in self.running}
        for slot in _slots(step):
            if self._on_device.get(slot, 0) > 1:
                self._on_device[slot] -= 1
            else:
                self._on_device.pop(slot, None)
        for chunk in step.plan.prefills:
            seq = by_slot.get(chunk.seq_id)
            # ended or preempted during this step: untouched
            if seq is not None and seq.status != Status.FINISHED and seq.slot == chunk.seq_id:
                seq.n_prefilled = max(seq.n_prefilled, chunk.end)  # a later chunk may be in flight
                seq.n_prefill_chunks += 1
        out = StepUpdate()
        for slot in step.sampled_slots():
            seq = by_slot.get(slot)
            if seq is not None and seq.in_flight > 0:
                seq.in_flight -= 1
            if seq is None or seq.status == Status.FINISHED or slot not in tokens:
                continue
            token = tokens[slot]
            seq.status = Status.DECODING
            seq.output_ids.append(token)
            seq.token_times.append(now)
            out.tokens.append((seq, token))
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason, now)
                out.finished.append(seq)
        return out

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if not seq.request.ignore_eos and self.is_eos(token):
            return FinishReason.STOP
        if len(seq.output_ids) >= seq.request.max_tokens:
            return FinishReason.LENGTH
        if seq.next_position + 1 >= self.caps.context_per_sequence:
            return FinishReason.LENGTH  # the context is full: no room for the next token
        return None

    def decoding(self) -> list[Sequence]:
        """Sequences that decode in the next step (with tokens in flight: while more may come)."""
        return [s for s in self.running if s.status == Status.DECODING and self._may_decode(s)]

    def _may_decode(self, s: Sequence) -> bool:
        if not s.in_flight:
            return True
        return (len(s.output_ids) + s.in_flight < s.request.max_tokens
                and s.next_position + s.in_flight + 1 < self.caps.context_per_sequence)

    def guarded(self) -> bool:
        return any(s.priority in self.protect for s in self.decoding())

    def turn_loading(self) -> bool:
        """A foreground prompt loads beside a streaming chat: background waits this step."""
        return self.guarded() and any(s.priority == FOREGROUND and s.status == Status.PREFILLING
                                      for s in self.running)

    def planned_decodes(self, turn_first: bool = False) -> int:
        """The decodes the next guarded step carries if its cap lets prompt tokens in;
        `turn_first`: a new turn loads first (the caller checked `turn_loading()`), so only
        the protected decodes ride."""
        decoding = self.decoding()
        if turn_first:
            return sum(1 for s in decoding if s.priority in self.protect)
        return len(decoding)

    def itl_target_s(self, default_s: float | None = None, spent_factor: float = 1.0) -> float | None:
        """The tightest ITL target among the streaming protected requests, each its own or
        `default_s` (None: none named one and no default). A reply that has had as many ITLs
        over its target as its own P99 absorbs counts at target / `spent_factor`: one more
        would fail its goal."""
        targets = []
        for s in self.decoding():
            target = s.request.itl_target_s or default_s
            if s.priority not in self.protect or target is None:
                continue
            if spent_factor != 1.0 and s.itls_over(target) >= s.excursions_absorbed():
                target /= spent_factor
            targets.append(target)
        return min(targets) if targets else None

    # -- planning ----------------------------------------------------------
    def plan(self, cap: int | None, bg_cap: int | None, background: bool = True,
             turn_first: bool = False) -> PlannedStep:
        """The next step. `background=False` (the thermal governor's hold) keeps every
        background prompt out of this step, guarded or not; background decodes still run.
        `turn_first` (a policy that plans new turns, `PrefillPolicy.plans_turns`): while a
        foreground prompt loads beside the streams, background prompts and decodes wait; a
        static cap or none shares the step as a stock runtime does.

        A guarded step's cap of 0, or a new turn loading beside the streams, keeps the
        unprotected (background) decodes waiting with the background prompts: another
        sequence in a CPU step costs about a whole decode, so they broke T in the steps the
        cap had kept free of prompt tokens. Under any other cap they join (the policy
        plans for every decode: `planned_decodes()`)."""
        decoding = self.decoding()
        prefilling = self._prefill_order()
        guarded = any(s.priority in self.protect for s in decoding)
        if not self.caps.multi_sequence:
            decoding, prefilling = self._time_slice(decoding, prefilling)
        n_held = 0
        protected = [s for s in decoding if s.priority in self.protect]
        fg_loading = any(s.priority == FOREGROUND for s in prefilling)
        turn_first = turn_first and guarded and fg_loading
        if guarded and (cap == 0 and background or turn_first):  # background decodes wait with its prompts
            n_held, decoding = len(decoding) - len(protected), protected

        # A token still in flight is fed from the device (pipelined engines).
        plan = StepPlan(decodes=[
            DecodeItem(s.slot, PLACEHOLDER_TOKEN if s.in_flight else s.output_ids[-1], s.next_position + s.in_flight)
            for s in decoding
        ])
        room = self.caps.max_batch_tokens - plan.n_decode
        if guarded and cap is not None:
            room = min(room, cap)
        counts = {FOREGROUND: 0, BACKGROUND: 0}
        for seq in prefilling:
            if seq.priority == BACKGROUND and (not background or turn_first):
                break  # prefilling is sorted foreground first
            limit = room
            if seq.priority == BACKGROUND and not guarded:
                if fg_loading:
                    break  # the foreground prompt gets the whole device
                if bg_cap is not None:
                    limit = min(limit, bg_cap - counts[BACKGROUND])
            n = min(seq.remaining_prompt, limit)
            if n <= 0:
                break
            start = seq.n_prefilled
            ids = seq.request.prompt_ids[start : start + n]
            plan.prefills.append(PrefillChunk(seq.slot, ids, start, start + n == seq.prompt_len))
            counts[seq.priority] += n
            room -= n
        return PlannedStep(
            plan=plan,
            guarded=guarded,
            cap=cap if guarded else None,
            bg_cap=bg_cap,
            n_prefill_fg=counts[FOREGROUND],
            n_prefill_bg=counts[BACKGROUND],
            seqs={s.slot: s for s in self.running},
            n_decode_held=n_held,
            n_decode_protected=len(protected),
        )

    def next_prompt_position(self, turn_first: bool = False) -> int | None:
        """Where the next step's first prompt chunk starts (None: no prompt loads): the cost of
        a prompt token grows with the context before it. `turn_first`: a foreground one."""
        return next((s.n_prefilled for s in self._prefill_order()
                     if not turn_first or s.priority == FOREGROUND), None)

    def _prefill_order(self) -> list[Sequence]:
        """Foreground prompts earliest deadline first, then background ones in admission order."""
        loading = [s for s in self.running if s.status == Status.PREFILLING]
        fg = sorted((s for s in loading if s.priority == FOREGROUND), key=self.deadline_s)  # stable: FIFO on ties
        return fg + [s for s in loading if s.priority != FOREGROUND]

    def deadline_s(self, seq: Sequence) -> float:
        goal = seq.request.ttft_goal_s
        return seq.arrival_s + (self.ttft_goal_s if goal is None else goal)

    def _time_slice(self, decoding: list[Sequence], prefilling: list[Sequence]):
        """One sequence per step for backends that cannot batch sequences.

        Decode steps and prefill chunks alternate, so a prompt still advances (under
        the cap, since the step stays guarded) while others decode; decoders take
        turns.
        """
        self._turn += 1
        if decoding and (not prefilling or self._turn % 2):
            return [decoding[(self._turn // 2) % len(decoding)]], []
        return [], prefilling[:1]


def _slots(step: PlannedStep) -> set[int]:
    return {d.seq_id for d in step.plan.decodes} | {c.seq_id for c in step.plan.prefills}


def _cached_tokens(seq: Sequence) -> list[int]:
    """The tokens whose KV a sequence's slot holds: the prompt as far as it was
    prefilled, then every output token but the last (sampled, never fed back)."""
    n = seq.n_prefilled + max(0, len(seq.output_ids) - 1)
    return (list(seq.request.prompt_ids) + seq.output_ids)[:n]
