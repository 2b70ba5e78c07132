from dlfp.protocol import TIMING_SYNC_WALL, Capabilities
from dlfp.scheduler import Scheduler
from dlfp.sequence import BACKGROUND, FOREGROUND, FinishReason, Request, Sequence, Status


def caps(multi=True, n_batch=64, slots=4):
    return Capabilities(True, multi, True, TIMING_SYNC_WALL, slots, 1024, n_batch, 100)


def seq(n_prompt, priority=FOREGROUND, decoding=False):
    s = Sequence(Request(list(range(1, n_prompt + 1)), 8, priority), arrival_s=0.0)
    if decoding:
        s.n_prefilled = n_prompt
        s.output_ids = [5]
    return s


def admitted(sched, *seqs):
    for s in seqs:
        sched.add(s)
    sched.admit()
    for s in seqs:
        if s.output_ids:
            s.status = Status.DECODING
    return seqs


def test_every_decode_joins_and_cap_is_shared_by_all_prompts():
    sched = Scheduler(caps())
    fg_dec, bg_dec, bg1, bg2 = admitted(
        sched, seq(10, decoding=True), seq(10, BACKGROUND, decoding=True), seq(50, BACKGROUND), seq(50, BACKGROUND)
    )
    step = sched.plan(cap=12, bg_cap=None)
    assert step.guarded and step.capped
    assert {d.seq_id for d in step.plan.decodes} == {fg_dec.slot, bg_dec.slot}
    assert step.plan.n_prefill == 12  # two long prompts do not each take the cap
    assert [c.seq_id for c in step.plan.prefills] == [bg1.slot]


def test_cap_zero_keeps_background_decodes_waiting():
    sched = Scheduler(caps())
    fg_dec, bg_dec, bg = admitted(sched, seq(10, decoding=True), seq(10, BACKGROUND, decoding=True),
                                  seq(50, BACKGROUND))
    step = sched.plan(cap=0, bg_cap=32)
    assert [d.seq_id for d in step.plan.decodes] == [fg_dec.slot]
    assert step.n_decode_held == 1 and step.plan.n_prefill == 0
    assert step.n_decode_protected == 1
    step = sched.plan(cap=1, bg_cap=32)  # any other cap: every decode joins
    assert len(step.plan.decodes) == 2 and step.n_decode_held == 0 and step.n_prefill_bg == 1
    assert step.n_decode_protected == 1  # one foreground ITL: what the controller's spread counts
    step = sched.plan(cap=0, bg_cap=32, background=False)  # the thermal hold keeps background decodes running
    assert len(step.plan.decodes) == 2 and step.n_decode_held == 0
    sched.finish(fg_dec, FinishReason.STOP, 0.0)
    step = sched.plan(cap=None, bg_cap=32)  # unguarded: nothing held
    assert [d.seq_id for d in step.plan.decodes] == [bg_dec.slot] and step.n_prefill_bg == 32
    assert step.n_decode_protected == 0


def test_foreground_prompt_goes_before_background():
    sched = Scheduler(caps())
    _, bg, fg = admitted(sched, seq(10, decoding=True), seq(40, BACKGROUND), seq(40, FOREGROUND))
    step = sched.plan(cap=50, bg_cap=None)
    assert [c.seq_id for c in step.plan.prefills] == [fg.slot, bg.slot]
    assert step.n_prefill_fg == 40 and step.n_prefill_bg == 10


def test_isolated_foreground_prefill_is_not_capped():
    sched = Scheduler(caps(n_batch=64))
    (fg,) = admitted(sched, seq(200))
    step = sched.plan(cap=None, bg_cap=8)
    assert not step.guarded
    assert step.plan.n_prefill == 64  # a full batch
    assert not step.plan.prefills[0].wants_logits


def test_isolated_background_prefill_uses_preemption_budget():
    sched = Scheduler(caps(n_batch=64))
    admitted(sched, seq(200, BACKGROUND))
    step = sched.plan(cap=None, bg_cap=20)
    assert step.plan.n_prefill == 20 and step.n_prefill_bg == 20 and not step.guarded and step.bg_cap == 20
    assert sched.plan(cap=None, bg_cap=None).plan.n_prefill == 64  # unbounded: whole batch


def test_background_waits_while_foreground_prompt_loads():
    sched = Scheduler(caps(n_batch=64))
    admitted(sched, seq(30, BACKGROUND), seq(20, FOREGROUND))
    step = sched.plan(cap=None, bg_cap=32)
    assert step.n_prefill_fg == 20 and step.n_prefill_bg == 0


def test_background_decode_does_not_guard():
    sched = Scheduler(caps(n_batch=64))
    admitted(sched, seq(10, BACKGROUND, decoding=True), seq(100, FOREGROUND))
    step = sched.plan(cap=4, bg_cap=8)
    assert not step.guarded
    assert step.n_prefill_fg == 63  # full batch less the background decode token


def test_last_chunk_wants_logits_and_batch_never_overflows():
    sched = Scheduler(caps(n_batch=16))
    (s,) = admitted(sched, seq(20))
    first = sched.plan(None, None).plan
    assert first.n_tokens == 16 and not first.prefills[0].wants_logits
    s.n_prefilled = 16
    second = sched.plan(None, None).plan
    assert second.prefills[0].token_ids == [17, 18, 19, 20] and second.prefills[0].wants_logits


def test_admission_respects_slots_and_priority():
    sched = Scheduler(caps(slots=3))
    b1, b2, b3, b4 = (seq(5, BACKGROUND) for _ in range(4))
    for s in (b1, b2, b3, b4):
        sched.add(s)
    assert sched.admit() == [b1, b2]  # with no foreground running, one slot stays free
    f1 = seq(5)
    sched.add(f1)
    assert sched.admit() == [f1]  # a new chat message finds its slot at once
    sched.finish(b1, FinishReason.STOP, 0.0)
    assert sched.admit() == [b3]  # beside a running foreground, background may use the rest
    sched.finish(f1, FinishReason.STOP, 0.0)
    sched.finish(b2, FinishReason.STOP, 0.0)
    assert sched.admit() == [b4]
    assert len(sched.free_slots) == 1 and b4.status == Status.PREFILLING


def test_two_slots_still_run_foreground_and_background_together():
    sched = Scheduler(caps(slots=2))
    f, b = seq(5), seq(5, BACKGROUND)
    sched.add(f)
    sched.add(b)
    assert sched.admit() == [f, b]


def test_time_slicing_for_single_sequence_backends():
    sched = Scheduler(caps(multi=False))
    dec, pre = admitted(sched, seq(10, decoding=True), seq(50, BACKGROUND))
    kinds = []
    for _ in range(4):
        step = sched.plan(cap=6, bg_cap=None)
        seqs = {d.seq_id for d in step.plan.decodes} | {c.seq_id for c in step.plan.prefills}
        assert len(seqs) == 1
        assert step.guarded  # a prefill step still counts as overlapping the decode
        kinds.append("d" if step.plan.decodes else "p")
        assert step.plan.n_prefill <= 6
    assert set(kinds) == {"d", "p"}


def test_update_advances_prompts_appends_tokens_and_finishes():
    """The scheduler owns a sequence's life after a step too (nano-vllm's postprocess)."""
    sched = Scheduler(caps(n_batch=64), is_eos=lambda t: t == 99)
    dec, long_bg, short_fg = admitted(sched, seq(4, decoding=True), seq(100, BACKGROUND), seq(3))
    dec.request.max_tokens = 2
    step = sched.plan(cap=None, bg_cap=None)
    slots = {s.slot: s for s in (dec, long_bg, short_fg)}
    tokens = {slot: 7 for slot in step.sampled_slots()}
    assert set(tokens) == {dec.slot, short_fg.slot}  # the long prompt is not done: no token yet
    out = sched.update(step, tokens, now=1.0)
    assert [(s, t) for s, t in out.tokens] == [(dec, 7), (short_fg, 7)]
    assert out.finished == [dec] and dec.finish_reason == FinishReason.LENGTH and dec.status == Status.FINISHED
    assert dec not in sched.running and dec.slot in sched.free_slots
    assert short_fg.status == Status.DECODING and short_fg.token_times == [1.0]
    assert long_bg.n_prefilled == 64 - 1 - 3 and long_bg.n_prefill_chunks == 1
    step = sched.plan(cap=None, bg_cap=None)
    out = sched.update(step, {short_fg.slot: 99}, now=2.0)  # end of generation
    assert short_fg in out.finished and short_fg.finish_reason == FinishReason.STOP
    assert slots  # slots were distinct
    assert sched.finish(short_fg, FinishReason.ABORT, 3.0) is False  # already ended: nothing changes


def test_cap_zero_keeps_background_out_and_a_new_turn_loads_first_under_the_cap():
    sched = Scheduler(caps())
    fg_dec, bg_dec, bg = admitted(sched, seq(10, decoding=True), seq(12, BACKGROUND, decoding=True), seq(40, BACKGROUND))
    step = sched.plan(cap=0, bg_cap=32)
    assert step.guarded and not step.capped and step.plan.n_prefill == 0 and step.cap == 0
    assert [d.seq_id for d in step.plan.decodes] == [fg_dec.slot]
    assert sched.planned_decodes() == 2 and not sched.turn_loading()
    (fg2,) = admitted(sched, seq(30, FOREGROUND))
    assert sched.turn_loading() and sched.planned_decodes(turn_first=True) == 1  # plan for the stream alone
    step = sched.plan(cap=0, bg_cap=32, turn_first=True)  # nothing fits beside the stream: the turn waits, no crawl
    assert step.plan.n_prefill == 0 and [d.seq_id for d in step.plan.decodes] == [fg_dec.slot]
    step = sched.plan(cap=3, bg_cap=32, turn_first=True)  # the cap goes to the new turn; background waits
    assert [(c.seq_id, len(c.token_ids)) for c in step.plan.prefills] == [(fg2.slot, 3)]
    assert [d.seq_id for d in step.plan.decodes] == [fg_dec.slot] and step.n_decode_held == 1
    step = sched.plan(cap=5, bg_cap=32)  # a static cap shares the step, the turn first (a stock runtime's way)
    assert [(c.seq_id, len(c.token_ids)) for c in step.plan.prefills] == [(fg2.slot, 5)]
    assert step.n_decode_held == 0 and sched.planned_decodes() == 2
    # Unguarded (the chat has finished): cap 0 is not in force; the budget sizes background.
    sched.finish(fg_dec, FinishReason.STOP, 0.0)
    sched.finish(fg2, FinishReason.STOP, 0.0)
    sched.finish(bg_dec, FinishReason.STOP, 0.0)
    step = sched.plan(cap=None, bg_cap=32)
    assert not step.guarded and step.n_prefill_bg == 32
