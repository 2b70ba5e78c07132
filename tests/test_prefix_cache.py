"""Slot choice by longest cached prefix, LRU eviction, and the scheduler's use of them."""
from dataclasses import replace

import pytest

from dlfp.protocol import TIMING_SYNC_WALL, Capabilities
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
    pc = PrefixCache(3)
    chat = pc.acquire([1, 2, 3], FOREGROUND, now=0.0)
    doc = pc.acquire([1, 2, 9], BACKGROUND, now=0.0)
    pc.release(doc.slot, [1, 2, 9], now=1.0)
    pc.release(chat.slot, [1, 2, 3, 4], now=2.0)  # the chat is the most recent and shares more
    g = pc.acquire([1, 2, 3, 4, 5], BACKGROUND, now=3.0)
    assert g.slot == doc.slot and g.reused == 2  # the document slot, though the chat's shares more
    # An empty slot serves the next document; then only the live conversation's is free:
    # background waits rather than evict it (a document still holds a slot, so it progresses).
    assert pc.acquire([8, 8], BACKGROUND, now=3.0).slot not in (chat.slot, doc.slot)
    assert pc.acquire([9, 9], BACKGROUND, now=3.0) is None
    assert pc.acquire([1, 2, 3, 4, 5], FOREGROUND, now=4.0).slot == chat.slot  # the next turn finds it


def test_a_conversation_idle_past_the_hold_time_counts_as_background():
    pc = PrefixCache(2, hold_s=60.0)
    chat = pc.acquire([1, 2, 3], FOREGROUND, now=0.0)
    doc = pc.acquire([5, 6], BACKGROUND, now=0.0)
    pc.release(chat.slot, [1, 2, 3, 4], now=10.0)
    assert pc.acquire([7, 7], BACKGROUND, now=70.0) is None  # 60 s idle: still live
    g = pc.acquire([7, 7], BACKGROUND, now=70.5)
    assert g is not None and g.slot == chat.slot and g.reused == 0
    pc.release(doc.slot, [5, 6], now=71.0)
    with pytest.raises(ValueError, match="hold time"):
        PrefixCache(2, hold_s=-1.0)


def test_background_always_progresses_when_every_slot_holds_a_live_conversation():
    pc = PrefixCache(3, hold_s=None)  # never expires
    grants = [pc.acquire([i, i], FOREGROUND, now=0.0) for i in range(1, 4)]
    for t, g in zip((1.0, 2.0, 3.0), (grants[1], grants[2], grants[0])):
        pc.release(g.slot, [g.slot + 1] * 3, now=t)
    g = pc.acquire([9, 9], BACKGROUND, now=5.0)
    assert g.slot == grants[1].slot  # the longest idle conversation pays, once
    assert pc.acquire([8, 8], BACKGROUND, now=5.0) is None  # a document holds a slot: the rest wait


def test_foreground_evicts_empty_then_background_then_the_least_recent_conversation():
    sys_prompt = [1, 2, 3, 4]
    pc = PrefixCache(3)
    a = pc.acquire(sys_prompt + [10, 11, 12, 13, 14], FOREGROUND, now=0.0)
    d = pc.acquire([50, 51], BACKGROUND, now=0.0)
    pc.release(a.slot, sys_prompt + [10, 11, 12, 13, 14, 15], now=1.0)
    pc.release(d.slot, [50, 51, 52], now=2.0)
    # A new conversation shares only the system prompt with chat a (under half of what a holds):
    # it takes the empty slot, not a's, though a's prefix is the longest.
    b = pc.acquire(sys_prompt + [20, 21], FOREGROUND, now=3.0)
    assert b.slot not in (a.slot, d.slot) and b.reused == 0
    pc.release(b.slot, sys_prompt + [20, 21, 22, 23, 24, 25], now=4.0)
    c = pc.acquire(sys_prompt + [30], FOREGROUND, now=5.0)
    assert c.slot == d.slot  # then the background slot
    pc.release(c.slot, sys_prompt + [30, 31, 32, 33, 34, 35], now=6.0)
    e = pc.acquire(sys_prompt + [40], FOREGROUND, now=7.0)
    assert e.slot == a.slot and e.reused == 4  # then the least recently used conversation


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
def run_to_end(sched, seq, outputs, now=0.0):
    """Pretend the sequence prefilled and generated `outputs`, then finished."""
    seq.n_prefilled = seq.prompt_len
    seq.output_ids = list(outputs)
    seq.status = Status.DECODING
    sched.finish(seq, FinishReason.LENGTH, now)


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


def chat_and_documents(hold_s=120.0, doc_s=30.0):
    """Scheduler-level replay of the multi-turn-ingest shape: 4 slots, a warm-up, 3 chats
    of 8 turns (48 new tokens and a 48-token reply a turn, 4 s a turn, 3 s of thought),
    starting at 1.5, 27 and 66 s, and 6 documents (`doc_s` each) queued at 1.5 s.
    Returns the fraction of the chats' prompt tokens that were reused."""
    sched = Scheduler(caps(slots=4), prefix_reuse=True, prefix_hold_s=hold_s)
    warm = submit(sched, range(5000, 5192))
    sched.admit(0.0)
    run_to_end(sched, warm, [1] * 4)
    docs = []
    sessions = [(start, k, [], 0) for k, start in enumerate((1.5, 27.0, 66.0))]  # (next arrival, id, history, turn)
    ends, cached, total, t = [], 0, 0, 0.0
    while t < 400 and (sessions or sched.has_work()):
        for seq, end in [e for e in ends if e[1] <= t]:
            ends.remove((seq, end))
            k, turn = map(int, seq.request.tag.split(",")) if seq.request.tag else (-1, 9)
            reply = [7_000_000 + 1000 * k + turn] * 48
            run_to_end(sched, seq, reply, t)
            if turn < 7:
                sessions.append((t + 3.0, k, list(seq.request.prompt_ids) + reply, turn + 1))
        if t == 1.5:
            docs = [submit(sched, range(10_000 * (i + 1), 10_000 * (i + 1) + 1536), BACKGROUND) for i in range(6)]
        for start, k, history, turn in [s for s in sessions if s[0] <= t]:
            sessions.remove((start, k, history, turn))
            prompt = (history or [1, 2, 3]) + [100_000 * (k + 1) + 100 * turn + j for j in range(48)]
            submit(sched, prompt, tag=f"{k},{turn}")
        for seq in sched.admit(t):
            ends.append((seq, t + (4.0 if seq.priority == FOREGROUND else doc_s)))
            if seq.priority == FOREGROUND:
                cached, total = cached + seq.n_cached, total + seq.prompt_len
        t += 0.5
    assert not sched.has_work() and all(d.status == Status.FINISHED for d in docs)
    return cached / total


def test_documents_do_not_evict_the_live_chats_in_the_multi_turn_ingest_shape():
    assert chat_and_documents() >= 0.85  # every turn after the first reuses its history (0.87 at most)
    assert chat_and_documents(hold_s=0.0) < 0.6  # no hold: documents take the chats' slots between turns


def test_the_hold_time_reaches_the_scheduler_from_every_entry_point():
    from click.testing import CliRunner

    from dlfp.assembly import build_engine
    from dlfp.sim import SimBackend
    from dlfp.bench.cli import bench
    from dlfp.cli import main
    from dlfp.profiles import load_profile
    from dlfp.prefix_cache import DEFAULT_HOLD_S

    profile = load_profile("cpu-laptop")
    engine = build_engine(SimBackend(), "dlfp", profile, probe_period_s=None, start=False, prefix_hold_s=7.5)
    assert engine.scheduler.cache.hold_s == 7.5
    assert build_engine(SimBackend(), "unbounded", profile, probe_period_s=None,
                        start=False).scheduler.cache.hold_s == DEFAULT_HOLD_S
    for command in (bench, main):
        args = ["--prefix-hold-s", "-1"] if command is bench else ["serve", "--prefix-hold-s", "-1"]
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 2 and "prefix-hold-s" in result.output
