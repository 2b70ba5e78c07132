"""The laptop job: one chat session in the foreground, document ingestion behind it.

Every policy runs the identical session (same prompts, same think times) on the
same loaded model, one after another, after a foreground-only run that measures
the decode-only ITL. Outputs are greedy, so every request's token ids must match
across policies. Each chat turn's prompt extends the previous one, so with prefix
reuse a turn prefills only its new part; the foreground-only run prefills every
prompt cold, so the exact-output check also proves reuse changes no token.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dlfp.protocol import Backend
from dlfp.assembly import build_engine
from dlfp.policy import params_to_dict, PrefillPolicy
from dlfp.devices.energy import energy_report
from dlfp.profiles import DeviceProfile
from dlfp.engine import Engine, InvalidRequest
from dlfp.metrics import itls, percentile, ttft
from dlfp.prefix_cache import DEFAULT_HOLD_S
from dlfp.provenance import write_config
from dlfp.runs import compress_traces
from dlfp.sequence import BACKGROUND, FOREGROUND, Request
from dlfp.trace import RequestRecord, Trace, control_counts, rule_counts
from dlfp.workloads.laptop import ChatScript, Document, chat_messages, summary_messages

DECODE_ONLY = "decode-only"
log = logging.getLogger("dlfp.laptop")


@dataclass
class LaptopSettings:
    policies: list[str]
    itl_target_ms: float
    profile: DeviceProfile
    script: ChatScript
    docs: list[Document]
    summary_tokens: int = 8  # a background summary is a few tokens: the job is the prefill
    fg_start_s: float = 1.0  # the first message arrives while ingestion is under way
    probe_period_s: float = 0.5
    out: Path | None = None
    cache_prompt: bool = True  # reuse cached prompt prefixes in the policy runs (llama.cpp's cache_prompt)
    prefix_hold_s: float = DEFAULT_HOLD_S  # a conversation's cached prefix is kept from background this long


@dataclass
class Session:
    label: str
    trace: Trace
    start: float
    end: float
    records: list[RequestRecord] = field(default_factory=list)

    def of(self, priority: str) -> list[RequestRecord]:
        return [r for r in self.records if r.priority == priority]


def run_session(
    backend: Backend,
    policy: str | PrefillPolicy,
    settings: LaptopSettings,
    label: str,
    with_background: bool = True,
    on_progress: Callable[[], None] | None = None,
) -> Session:
    engine = build_engine(backend, policy, settings.profile, itl_target_ms=settings.itl_target_ms,
                          probe_period_s=settings.probe_period_s, prefix_hold_s=settings.prefix_hold_s)
    start = engine.clock()
    cache = settings.cache_prompt and label != DECODE_ONLY  # the reference run is cold
    try:
        bg = _ingest(engine, backend, settings, with_background, on_progress)
        time.sleep(settings.fg_start_s)
        _chat(engine, backend, settings.script, on_progress, cache)
        for h in bg:
            h.result()
        end = engine.clock()
    finally:
        engine.shutdown(abort_pending=False)
    return Session(label, engine.trace, start, end, list(engine.trace.requests))


def _ingest(engine: Engine, backend: Backend, settings: LaptopSettings, enabled: bool, on_progress) -> list:
    """Submit every document as a background summary request (all at once: a folder drop)."""
    bg = []
    if not enabled:
        return bg
    for doc in settings.docs:
        ids = backend.apply_chat_template(summary_messages(doc))
        req = Request(ids, settings.summary_tokens, BACKGROUND, request_id=f"bg-{doc.name}", tag=doc.name,
                      cache_prompt=settings.cache_prompt)
        try:
            handle = engine.submit(req)
        except InvalidRequest as exc:  # recorded in the trace; the other documents go on
            log.warning("document %s refused: %s", doc.name, exc)
            continue
        if on_progress:
            threading.Thread(target=_notify_when_done, args=(handle, on_progress), daemon=True).start()
        bg.append(handle)
    return bg


def _notify_when_done(handle, callback) -> None:
    handle.result()
    callback()


def _chat(engine: Engine, backend: Backend, script: ChatScript, on_progress, cache_prompt: bool = True) -> None:
    history: list[tuple[str, str]] = []
    for i, user in enumerate(script.turns):
        ids = backend.apply_chat_template(chat_messages(script, history, user))
        try:
            handle = engine.submit(Request(ids, script.max_tokens, FOREGROUND, request_id=f"fg-turn-{i}",
                                           tag=f"turn {i}", cache_prompt=cache_prompt))
        except InvalidRequest as exc:  # recorded in the trace; the session cannot go on without history
            log.warning("chat turn %d refused: %s", i, exc)
            return
        reply = backend.detokenize(list(handle))
        history.append((user, reply.strip()))
        if on_progress:
            on_progress()
        if i + 1 < len(script.turns):
            time.sleep(script.think_time_s)


def session_summary(s: Session) -> dict:
    fg, bg = s.of(FOREGROUND), s.of(BACKGROUND)
    fg_itl = [g for r in fg if r.ok for g in itls(r)]
    fg_ttft = [ttft(r) for r in fg if r.ok and r.token_times]
    bg_steps = [st for st in s.trace.steps if st.n_prefill_bg]
    bg_tokens = sum(st.n_prefill_bg for st in bg_steps)
    bg_span = (bg_steps[-1].t1 - s.start) if bg_steps else 0.0
    return {
        "fg_itl_p50_ms": _ms(percentile(fg_itl, 50)),
        "fg_itl_p99_ms": _ms(percentile(fg_itl, 99)),
        "fg_itl_max_ms": _ms(max(fg_itl) if fg_itl else None),
        "fg_ttft_p50_ms": _ms(percentile(fg_ttft, 50)),
        "fg_ttft_p99_ms": _ms(percentile(fg_ttft, 99)),
        "fg_ttft_by_turn_ms": [_ms(ttft(r)) if r.ok and r.token_times else None for r in _turns(fg)],
        "fg_prompt_tokens": sum(r.prompt_len for r in fg),
        "fg_prompt_tokens_reused": sum(r.cached_prompt_tokens for r in fg),
        "bg_prefill_tokens": bg_tokens,
        "bg_prefill_tokens_per_s": bg_tokens / bg_span if bg_span > 0 else None,
        "bg_docs_done": sum(1 for r in bg if r.ok),
        "fg_turns_done": sum(1 for r in fg if r.ok),
        "requests_failed": sum(1 for r in s.records if not r.ok),
        "wall_s": s.end - s.start,
        "time_split_s": time_split(s),
        "energy": energy_report(s.trace.samples, s.start, s.end, s.trace.steps, s.trace.requests),
        "governor_holds": sum(1 for st in s.trace.steps if st.governor and st.governor != "clear"),
        **control_counts(s.trace.steps, s.trace.max_threads),
        "decision_rules": rule_counts(s.trace.steps),
        "notes": list(s.trace.notes),
    }


def _turns(fg: list[RequestRecord]) -> list[RequestRecord]:
    """Foreground records in turn order (ids fg-turn-<i>)."""
    return sorted(fg, key=lambda r: int(r.request_id.rsplit("-", 1)[-1]) if r.request_id[-1:].isdigit() else 0)


def time_split(s: Session) -> dict:
    """Where the wall time went: guarded steps, budgeted background chunks, the rest."""
    split = {"fg_decode_steps": 0.0, "bg_alone_steps": 0.0, "fg_prefill_alone_steps": 0.0, "other_steps": 0.0}
    for st in s.trace.steps:
        if st.guarded:
            split["fg_decode_steps"] += st.duration_s
        elif st.n_prefill_fg:
            split["fg_prefill_alone_steps"] += st.duration_s
        elif st.n_prefill_bg:
            split["bg_alone_steps"] += st.duration_s
        else:
            split["other_steps"] += st.duration_s
    split["idle_and_overhead"] = (s.end - s.start) - sum(split.values())
    bg_in_guarded = sum(st.n_prefill_bg for st in s.trace.steps if st.guarded)
    split["bg_tokens_beside_fg_decode"] = bg_in_guarded
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in split.items()}


def outputs_match(sessions: list[Session]) -> tuple[bool, list[str]]:
    """Every request (by id) produced the same token ids in every session that ran it."""
    seen: dict[str, list[int]] = {}
    mismatches = []
    for s in sessions:
        for r in s.records:
            if r.request_id in seen and seen[r.request_id] != r.output_ids:
                mismatches.append(f"{r.request_id} differs in {s.label}")
            seen.setdefault(r.request_id, r.output_ids)
    return not mismatches, mismatches


def run_laptop(backend: Backend, settings: LaptopSettings, on_progress=None, on_session=None) -> dict:
    sessions = []
    params = settings.profile.controller_params(settings.itl_target_ms)
    runs = [(DECODE_ONLY, "dlfp", False)] + [(p, p, True) for p in settings.policies]
    for label, spec, with_bg in runs:
        if on_session:
            on_session(label)
        # The spec, not a built policy: build_engine reads what it implies (its budget too).
        sessions.append(run_session(backend, spec, settings, label, with_bg, on_progress))
        if label == DECODE_ONLY:  # say it now, not after the policy runs
            for note in target_notes(settings.itl_target_ms, _decode_only_ms(sessions[0])):
                log.warning(note)
    decode_only, policy_sessions = sessions[0], sessions[1:]
    match, mismatches = outputs_match(sessions)
    decode_only_ms = _decode_only_ms(decode_only)
    summary = {
        "model": backend.describe().get("model_path"),
        "backend": backend.describe(),
        "profile": settings.profile.name,
        "itl_target_ms": settings.itl_target_ms,
        "controller": params_to_dict(params),
        "decode_only_itl_ms": decode_only_ms,
        "target_below_decode_only": target_below_decode_only(settings.itl_target_ms, decode_only_ms),
        "notes": target_notes(settings.itl_target_ms, decode_only_ms),
        "exact_output_match": match,
        "mismatches": mismatches,
        "policies": {s.label: session_summary(s) for s in policy_sessions},
    }
    if settings.out is not None:
        write_outputs(settings.out, summary, sessions)
    return summary


def _decode_only_ms(s: Session) -> float | None:
    return _ms(percentile([g for r in s.records for g in itls(r)], 50))


def target_below_decode_only(target_ms: float, decode_only_ms: float | None) -> bool:
    """True when one decode step alone (the median with no background) already misses the target."""
    return decode_only_ms is not None and decode_only_ms >= target_ms


def target_notes(target_ms: float, decode_only_ms: float | None) -> list[str]:
    if not target_below_decode_only(target_ms, decode_only_ms):
        return []
    return [f"ITL target {target_ms:.0f} ms is below this backend's decode-only ITL ({decode_only_ms:.0f} ms, "
            f"the median with no background work): one decode alone misses it, so no policy can meet it. "
            f"Pick --itl-target-ms above {decode_only_ms:.0f} (a few times it leaves room for background prefill)."]


def write_outputs(out: Path, summary: dict, sessions: list[Session]) -> None:
    """summary.json, each session's traces (and their gzip copies, the ones a kept run tracks)
    and config.json: the command, commit, host, threads and model hash behind the figures."""
    out.mkdir(parents=True, exist_ok=True)
    for s in sessions:
        s.trace.write(out, s.label.replace(":", "-"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    compress_traces(out)
    backend = summary["backend"]
    write_config(out, {"itl_target_ms": summary["itl_target_ms"], "policies": list(summary["policies"]),
                       "profile": summary["profile"], "controller": summary["controller"], "backend": backend},
                 models=[summary["model"]], threads=backend.get("n_threads"))


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)
