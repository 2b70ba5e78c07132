"""Conversations keep their cached prefix while background work is slowed (SIMULATED backend).

Three conversations of six turns beside six long documents submitted at once, four
slots. Under a prefill cap the documents progress slowly; were they to keep the slots
they took, the conversations would share what is left and each new turn would evict
another conversation's prefix, then re-prefill its whole history under the cap (the
eviction circle). The slot policy gives the conversations their slots instead."""
import numpy as np
import pytest

from dlfp.assembly import build_engine
from dlfp.prefix_cache import EVICT_CONVERSATION_FOR_FOREGROUND, PREEMPT_BACKGROUND, PrefixCache
from dlfp.profiles import load_profile
from dlfp.sequence import BACKGROUND, FOREGROUND, Request
from dlfp.sim import SimBackend, SimCost, VirtualClock

TURNS, CONVS, DOCS = 6, 3, 6


def multi_turn_ingest(policy: str, seed: int = 1, doc_len: int = 1536) -> dict:
    rng = np.random.default_rng(seed)
    clock = VirtualClock()
    backend = SimBackend(SimCost(), clock=clock, max_sequences=4, context=2048, max_batch_tokens=512,
                         prefix_reuse=True)
    engine = build_engine(backend, policy, load_profile("cpu-laptop"), probe_period_s=None, governor=False,
                          clock=clock.now, start=False)
    history = {c: rng.integers(1, 1000, 192).tolist() for c in range(CONVS)}
    next_turn = {c: 0.5 + 3.0 * c for c in range(CONVS)}
    turns: list[tuple[int, object, int]] = []  # (turn, record, tokens of history the turn could reuse)

    def submit_turn(c: int) -> None:
        prompt = history[c] + rng.integers(1, 1000, 48).tolist()
        k = sum(1 for t in turns if t[1].request_id.startswith(f"c{c}t"))

        def on_event(ev, c=c, prompt=prompt, k=k) -> None:
            if ev.finish_reason is None:
                return
            record = engine.trace.requests[-1]
            turns.append((k, record, len(history[c]) if k else 0))
            history[c] = prompt + record.output_ids
            next_turn[c] = ev.t + 2.0 if k + 1 < TURNS else None

        engine.submit(Request(prompt, 48, FOREGROUND, ignore_eos=True, request_id=f"c{c}t{k}"), on_event=on_event)
        next_turn[c] = None

    for d in range(DOCS):
        engine.submit(Request(rng.integers(1, 1000, doc_len).tolist(), 8, BACKGROUND, ignore_eos=True,
                              request_id=f"doc{d}"))
    while clock.t < 900:
        for c in range(CONVS):
            if next_turn[c] is not None and clock.t >= next_turn[c]:
                submit_turn(c)
        if not engine.step():
            pending = [t for t in next_turn.values() if t is not None]
            if not pending:
                break
            clock.t = min(pending)
        clock.t += 0.0003
    docs = [r for r in engine.trace.requests if r.priority == BACKGROUND]
    return {
        "reused": sum(r.cached_prompt_tokens for _, r, _ in turns),
        "reusable": sum(n for _, _, n in turns),
        "turns": turns,
        "docs": {r.request_id: r for r in docs},
        "evictions": dict(engine.trace.slot_evictions),
        "ok": all(r.ok for r in engine.trace.requests) and len(turns) == TURNS * CONVS and len(docs) == DOCS,
    }


@pytest.mark.parametrize("seed", [1, 7])
def test_conversations_keep_their_prefix_beside_slow_documents(seed):
    capped = multi_turn_ingest("dlfp", seed)
    assert capped["ok"]
    assert capped["reused"] >= 0.95 * capped["reusable"], capped["evictions"]
    assert capped["evictions"].get(EVICT_CONVERSATION_FOR_FOREGROUND, 0) == 0
    later = [r.token_times[0] - r.arrival_s for k, r, _ in capped["turns"] if k >= 3]
    first = [r.token_times[0] - r.arrival_s for k, r, _ in capped["turns"] if k == 0]
    assert np.mean(later) <= np.mean(first)


def test_preempted_documents_start_over_and_end_as_they_would_have():
    capped, free = multi_turn_ingest("dlfp"), multi_turn_ingest("unbounded")
    assert capped["evictions"].get(PREEMPT_BACKGROUND, 0) >= 1
    assert sum(r.preemptions for r in capped["docs"].values()) == capped["evictions"][PREEMPT_BACKGROUND]
    assert {k: r.output_ids for k, r in capped["docs"].items()} == {k: r.output_ids for k, r in free["docs"].items()}
    last = lambda run: max(r.finished_s for r in run["docs"].values())  # noqa: E731
    assert last(capped) <= 1.5 * last(free)


def test_background_holds_what_the_conversations_leave_and_at_least_one_slot():
    cache = PrefixCache(4, hold_s=60.0)
    for k in range(3):  # three conversations ended their turns (live, free)
        g = cache.acquire([k + 1] * 10, FOREGROUND, now=0.0)
        cache.release(g.slot, [k + 1] * 10, now=1.0)
    assert cache.background_share(2.0) == 1
    assert cache.acquire([9] * 10, BACKGROUND, now=2.0) is not None  # the one spare slot
    assert cache.acquire([8] * 10, BACKGROUND, now=2.0) is None  # no conversation's slot for a second
    assert cache.background_share(200.0) == 4 - 0  # the conversations expired: all slots


def test_slots_whose_step_failed_on_the_device_stay_preemptible():
    """A launched step never comes back when it fails (its requests end with the error): the
    slots it ran on must not count as busy on the device for the next requests that hold them."""
    from dlfp.protocol import TIMING_SYNC_WALL, Capabilities
    from dlfp.scheduler import Scheduler
    from dlfp.sequence import FinishReason, Sequence, Status

    def request(rid: str, priority: str, first: int) -> Sequence:
        return Sequence(Request(list(range(first, first + 200)), 4, priority, request_id=rid), arrival_s=0.0)

    sched = Scheduler(Capabilities(True, True, True, TIMING_SYNC_WALL, 3, 1024, 256, 2000, prefix_reuse=True),
                      prefix_reuse=True)
    sched.add(request("chat0", FOREGROUND, 1))
    sched.add(request("doc0", BACKGROUND, 300))
    sched.add(request("doc1", BACKGROUND, 600))
    chat0, doc0, doc1 = sched.admit(now=0.0)
    chat0.n_prefilled, chat0.output_ids, chat0.status = 200, [5], Status.DECODING  # the chat streams
    step = sched.plan(cap=250, bg_cap=None)
    assert {c.seq_id for c in step.plan.prefills} == {doc0.slot, doc1.slot}
    sched.launched(step)  # pipelined: on the device, not yet back; then it fails there
    for seq in (chat0, doc0, doc1):
        sched.finish(seq, FinishReason.ERROR, now=0.1, error="device step failed")
    sched.add(request("chat0-again", FOREGROUND, 1))
    sched.add(request("doc2", BACKGROUND, 900))
    sched.add(request("doc3", BACKGROUND, 1200))
    assert len(sched.admit(now=0.2)) == 3  # the same three slots
    sched.add(request("chat1", FOREGROUND, 1500))  # background (two slots) is over its share now
    assert [s.request.request_id for s in sched.admit(now=0.3)] == ["chat1"]
    assert sched.cache.evictions.get(PREEMPT_BACKGROUND) == 1
