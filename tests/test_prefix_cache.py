"""Slot choice by longest cached prefix, LRU eviction, and the scheduler's use of them."""
from dataclasses import replace

from dlfp.backends.protocol import TIMING_SYNC_WALL, Capabilities
from dlfp.prefix_cache import PrefixCache, common_prefix
from dlfp.scheduler import Scheduler
from dlfp.sequence import BACKGROUND, FOREGROUND, FinishReason, Request, Sequence, Status


def caps(slots=2, reuse=True):
    return Capabilities(True, True, True, TIMING_SYNC_WALL, slots, 1024, 64, 1000, prefix_reuse=reuse)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([9], [1]) == 0 and common_prefix([], [1]) == 0


def test_longest_prefix_wins_and_one_token_is_left_to_prefill():
    pc = PrefixCache(3)
    a = pc.acquire([1, 2, 3], FOREGROUND)
    b = pc.acquire([7, 8, 9, 10], FOREGROUND)
    pc.release(a.slot, [1, 2, 3, 4, 5])
    pc.release(b.slot, [7, 8, 9, 10, 11])
    g = pc.acquire([7, 8, 9, 10, 11, 12], FOREGROUND)
    assert (g.slot, g.reused) == (b.slot, 5)
    pc.release(g.slot, [7, 8, 9, 10, 11, 12])
    whole = pc.acquire([1, 2, 3, 4, 5], FOREGROUND)  # all cached: the last token is recomputed for its logits
    assert (whole.slot, whole.reused) == (a.slot, 4)


def test_ties_and_misses_go_to_the_least_recently_used_slot():
    pc = PrefixCache(3)
    grants = [pc.acquire([i + 1, 50], FOREGROUND) for i in range(3)]
    for g in (grants[1], grants[0], grants[2]):  # release order = recency: slot 1 oldest
        pc.release(g.slot, [g.slot + 1, 50])
    miss = pc.acquire([99, 98], FOREGROUND)
    assert (miss.slot, miss.reused) == (grants[1].slot, 0)  # LRU evicted
    pc.release(miss.slot, [99, 98])
    # An empty (never used) slot counts as least recent of all.
    pc2 = PrefixCache(2)
    g = pc2.acquire([1, 2], FOREGROUND)
    pc2.release(g.slot, [1, 2])
    assert pc2.acquire([3, 4], FOREGROUND).slot != g.slot


def test_background_keeps_off_a_conversation_slot_while_another_can_serve():
    pc = PrefixCache(2)
    chat = pc.acquire([1, 2, 3], FOREGROUND)
    doc = pc.acquire([1, 2, 9], BACKGROUND)
    pc.release(doc.slot, [1, 2, 9])
    pc.release(chat.slot, [1, 2, 3, 4])  # the chat is the most recent and shares more
    g = pc.acquire([1, 2, 3, 4, 5], BACKGROUND)
    assert g.slot == doc.slot and g.reused == 2  # the document slot, though the chat's shares more
    # With only the conversation's slot free, background takes it (LRU among what is left).
    assert pc.acquire([8, 8], BACKGROUND).slot == chat.slot


def test_opt_out_and_disabled_pool_reuse_nothing():
    pc = PrefixCache(1)
    g = pc.acquire([1, 2, 3], FOREGROUND)
    pc.release(g.slot, [1, 2, 3])
    g = pc.acquire([1, 2, 3, 4], FOREGROUND, reuse=False)
    assert g.reused == 0
    pc.release(g.slot, [1, 2, 3, 4])  # what it computed is reusable by a later request
    assert pc.acquire([1, 2, 3, 4, 5], FOREGROUND).reused == 4
    off = PrefixCache(1, enabled=False)
    g = off.acquire([1, 2], FOREGROUND)
    off.release(g.slot, [1, 2])
    assert not off.holds(g.slot) and off.acquire([1, 2, 3], FOREGROUND).reused == 0


def test_failed_request_leaves_an_untrusted_cache():
    pc = PrefixCache(1)
    g = pc.acquire([1, 2, 3], FOREGROUND)
    pc.release(g.slot, None)
    assert not pc.holds(g.slot) and pc.acquire([1, 2, 3, 4], FOREGROUND).reused == 0


# -- the scheduler ---------------------------------------------------------------
def run_to_end(sched, seq, outputs):
    """Pretend the sequence prefilled and generated `outputs`, then finished."""
    seq.n_prefilled = seq.prompt_len
    seq.output_ids = list(outputs)
    seq.status = Status.DECODING
    sched.finish(seq, FinishReason.LENGTH, 0.0)


def submit(sched, prompt, priority=FOREGROUND, **kw):
    s = Sequence(Request(list(prompt), 4, priority, **kw), arrival_s=0.0)
    sched.add(s)
    return s


def test_scheduler_admits_the_next_turn_to_its_conversation_and_plans_only_the_suffix():
    sched = Scheduler(caps(), prefix_reuse=True)
    turn1 = submit(sched, range(1, 41))
    doc = submit(sched, range(100, 160), BACKGROUND)
    sched.admit()
    run_to_end(sched, turn1, [41, 42, 43])  # KV holds the prompt and outputs 41, 42
    run_to_end(sched, doc, [7])
    assert sched.keeps_cache(turn1.slot) and sched.keeps_cache(doc.slot)
    turn2 = submit(sched, list(range(1, 44)) + [60, 61, 62])
    sched.admit()
    assert turn2.slot == turn1.slot and turn2.n_cached == 42 and turn2.n_prefilled == 42
    step = sched.plan(cap=None, bg_cap=None)
    (chunk,) = step.plan.prefills
    assert (chunk.start, chunk.token_ids, chunk.wants_logits) == (42, [43, 60, 61, 62], True)


def test_scheduler_cap_applies_to_the_suffix():
    sched = Scheduler(caps(), prefix_reuse=True)
    first = submit(sched, range(1, 201))
    sched.admit()
    run_to_end(sched, first, [201, 202])
    decoding = submit(sched, [900, 901], BACKGROUND)
    again = submit(sched, list(range(1, 203)) + list(range(300, 340)))
    sched.admit()
    decoding.n_prefilled, decoding.output_ids, decoding.status = 2, [5], Status.DECODING
    sched.protect = (BACKGROUND,)  # make the background decode a guarded one for this check
    step = sched.plan(cap=8, bg_cap=None)
    assert again.n_cached == 201 and step.plan.prefills[0].start == 201 and step.plan.n_prefill == 8


def test_scheduler_without_backend_support_reuses_nothing():
    sched = Scheduler(caps(reuse=False), prefix_reuse=True)
    a = submit(sched, range(1, 20))
    sched.admit()
    run_to_end(sched, a, [5, 6])
    b = submit(sched, range(1, 30))
    sched.admit()
    assert b.n_cached == 0 and not sched.keeps_cache(a.slot)


def test_opt_out_request_and_error_finish():
    sched = Scheduler(caps(slots=1), prefix_reuse=True)
    a = submit(sched, range(1, 20))
    sched.admit()
    run_to_end(sched, a, [5, 6])
    b = submit(sched, range(1, 30), cache_prompt=False)
    sched.admit()
    assert b.n_cached == 0
    sched.finish(b, FinishReason.ERROR, 0.0, "boom")
    assert not sched.keeps_cache(b.slot)


def test_forget_prefix_resets_the_grant():
    sched = Scheduler(replace(caps(slots=1)), prefix_reuse=True)
    a = submit(sched, range(1, 20))
    sched.admit()
    run_to_end(sched, a, [5])
    b = submit(sched, range(1, 30))
    sched.admit()
    assert b.n_cached == 19  # the prompt; the output 5 was sampled, never fed back
    sched.forget_prefix(b)
    assert b.n_cached == 0 and b.n_prefilled == 0
