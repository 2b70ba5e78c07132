"""The backend conformance suite: the contract an owned-loop adapter must keep.

Plain Python, so any adapter can run it: `run_all(factory)` opens one backend,
runs every check in CHECKS and returns a CheckResult per check. A pytest file
parametrises over (backend, check); the command `dlfp check-backend NAME` prints
the same results and exits non-zero on a failure.

What the engine relies on, check by check:
- chunked_prefill: a prompt prefilled in chunks gives the next-token logits of one
  whole prefill (within LOGIT_TOL of the logits' spread) and the same greedy tokens;
- riding_chunk: a decode with another sequence's prefill chunk in its step gives the
  same greedy tokens as without (skipped when the adapter declares multi_sequence=False);
- isolation: freeing, reusing or advancing one sequence never changes another;
- completion_timing: the reported duration is the completed work: positive, not more
  than the call took, most of the call for a big step (not the launch time), larger
  for a step with more work, and the returned logits are final (never change later);
- capabilities: the declared limits are true; an adapter that declares
  multi_sequence=False refuses a two-sequence plan, and the engine (which then
  time-slices) still serves two concurrent requests with their solo outputs;
- prefix_reuse: for an adapter that declares it, a slot that keeps a cached prefix
  (`keep_prefix`) and prefills the rest gives the logits of a cold prefill (within
  LOGIT_TOL) and the same greedy tokens, for a next chat turn (prompt + reply + more),
  a shorter prompt, and a prompt that shares nothing; one that does not declare it
  must not claim to keep a prefix;
- cut_steps: for an adapter that declares it, a step cut at once (`step_within(plan, 0)`)
  returns `cut` with no logits and leaves every cache as it was: the same step run
  again, and the greedy tokens after it, are a never-cut run's, and a `cut_step()` made
  while no step runs does not cut the next one; one that does not declare it is never
  asked (the default `step_within` runs the step whole);
- bad_input: an out-of-range token id, a sequence past its context, an oversized step
  or an unknown slot give BackendError/ValueError, and the backend keeps working.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import click
import numpy as np

from dlfp.protocol import (
    TIMING_DEVICE_EVENT,
    TIMING_OUTPUT_READY,
    TIMING_SYNC_WALL,
    Backend,
    BackendError,
    Capabilities,
    DecodeItem,
    PrefillChunk,
    StepPlan,
)

PASS, FAIL, SKIP = "pass", "fail", "skip"
# Chunked and whole prefill run different kernels (batch sizes, quantised activations):
# logits may differ by float reordering, never by more than this share of their spread.
LOGIT_TOL = 0.02
PROMPT_LEN = 48
GREEDY_STEPS = 8
TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening, trimmed the wick, "
    "wound the clockwork that turned the lens, and wrote the weather in a log book. "
)


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip
    detail: str

    @property
    def ok(self) -> bool:
        return self.status != FAIL


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# -- helpers -------------------------------------------------------------------
def prompt(backend: Backend, n: int = PROMPT_LEN, variant: int = 0) -> list[int]:
    """n token ids of ordinary text (shifted by `variant` for a different prompt)."""
    ids = backend.tokenize(TEXT * 4, add_special=False)
    ids = ids[variant * 7 :] + ids[: variant * 7]
    expect(len(ids) >= n, f"tokenizer gave only {len(ids)} tokens for the test text")
    return ids[:n]


def free_all(backend: Backend) -> None:
    for slot in range(backend.capabilities.max_sequences):
        backend.free_sequence(slot)


def prefill(backend: Backend, slot: int, ids: list[int], chunks: list[int] | None = None,
            start: int = 0) -> np.ndarray:
    """Prefill `ids[start:]` into `slot` (the slot already holds the first `start`) in the
    given chunk sizes (default: whole); last logits."""
    sizes = chunks or [len(ids) - start]
    logits = None
    for size in sizes:
        piece = ids[start : start + size]
        last = start + size == len(ids)
        r = backend.step(StepPlan(prefills=[PrefillChunk(slot, piece, start, last)]))
        start += size
        if last:
            logits = r.logits[slot]
    expect(logits is not None, "chunk sizes do not cover the prompt")
    return logits


def greedy_decode(backend: Backend, slot: int, first: np.ndarray, position: int, n: int,
                  rider: Callable[[int], list[PrefillChunk]] | None = None) -> list[int]:
    """n greedy tokens; `rider(i)` adds prefill chunks to decode step i."""
    out = [int(np.argmax(first))]
    for i in range(n - 1):
        plan = StepPlan(decodes=[DecodeItem(slot, out[-1], position + i)], prefills=rider(i) if rider else [])
        out.append(int(np.argmax(backend.step(plan).logits[slot])))
    return out


def chunks_of(total: int, size: int) -> list[int]:
    """`total` tokens in chunks of `size`, the last one shorter."""
    return [size] * (total // size) + ([total % size] if total % size else [])


def chunk_sizes(total: int, limit: int) -> list[int]:
    """About three chunks, none over `limit`."""
    return chunks_of(total, max(1, min(limit, total // 3)))


def logit_gap(a: np.ndarray, b: np.ndarray) -> float:
    """Largest difference as a share of the logits' spread."""
    return float(np.max(np.abs(a - b)) / max(float(np.ptp(a)), 1e-12))


def reference(backend: Backend, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """One sequence alone in slot 0: whole prefill, then greedy decode."""
    free_all(backend)
    first = prefill(backend, 0, ids)
    tokens = greedy_decode(backend, 0, first, len(ids), GREEDY_STEPS)
    free_all(backend)
    return first, tokens


# -- the checks ------------------------------------------------------------------
def check_chunked_prefill(backend: Backend) -> str:
    ids = prompt(backend)
    whole, ref_tokens = reference(backend, ids)
    sizes = chunk_sizes(len(ids), backend.capabilities.max_batch_tokens)
    chunked = prefill(backend, 0, ids, sizes)
    tokens = greedy_decode(backend, 0, chunked, len(ids), GREEDY_STEPS)
    free_all(backend)
    gap = logit_gap(whole, chunked)
    expect(gap <= LOGIT_TOL, f"chunks {sizes}: logits differ by {gap:.2e} of their spread (tolerance {LOGIT_TOL})")
    expect(tokens == ref_tokens, f"greedy tokens differ: chunked {tokens} vs whole {ref_tokens}")
    return f"chunks {sizes}: logit gap {gap:.1e} <= {LOGIT_TOL}; {GREEDY_STEPS} greedy tokens equal"


def check_riding_chunk(backend: Backend) -> str | None:
    caps = backend.capabilities
    if caps.max_sequences < 2:
        return None  # not applicable: one slot has nothing to ride beside
    ids, other = prompt(backend), prompt(backend, variant=1)
    _, ref_tokens = reference(backend, ids)
    size = max(1, min(8, caps.max_batch_tokens - 1, len(other) // GREEDY_STEPS))

    def rider(i: int) -> list[PrefillChunk]:
        start = i * size
        return [PrefillChunk(1, other[start : start + size], start, False)] if start + size <= len(other) else []

    first = prefill(backend, 0, ids)
    tokens = greedy_decode(backend, 0, first, len(ids), GREEDY_STEPS, rider)
    free_all(backend)
    expect(tokens == ref_tokens, f"greedy tokens with a {size}-token chunk riding: {tokens} vs alone {ref_tokens}")
    return f"{GREEDY_STEPS} greedy tokens equal with a {size}-token chunk of another sequence in each step"


def check_isolation(backend: Backend) -> str | None:
    caps = backend.capabilities
    if caps.max_sequences < 2:
        return None
    ids = prompt(backend)
    _, ref_tokens = reference(backend, ids)
    first = prefill(backend, 0, ids)
    out = [int(np.argmax(first))]
    # Another sequence prefills, advances, is freed and its slot reused, between seq 0's steps.
    b1 = prompt(backend, variant=2)
    prefill(backend, 1, b1)
    for i in range(GREEDY_STEPS - 1):
        if i == 2:
            backend.free_sequence(1)
            b1 = prompt(backend, 24, variant=3)
            prefill(backend, 1, b1)
        backend.step(StepPlan(decodes=[DecodeItem(1, b1[i % len(b1)], len(b1) + (i if i < 2 else i - 2))]))
        r = backend.step(StepPlan(decodes=[DecodeItem(0, out[-1], len(ids) + i)]))
        out.append(int(np.argmax(r.logits[0])))
    free_all(backend)
    expect(out == ref_tokens, f"sequence 0 changed while sequence 1 was advanced/freed/reused: {out} vs {ref_tokens}")
    return "sequence 0's greedy tokens unchanged while sequence 1 prefilled, decoded, was freed and reused"


def check_prefix_reuse(backend: Backend) -> str | None:
    """A kept prefix plus a prefilled suffix equals a cold prefill of the whole prompt."""
    if not backend.capabilities.prefix_reuse:  # the engine never asks; the adapter must not claim it either
        free_all(backend)
        expect(not backend.keep_prefix(0, 0), "prefix_reuse=False, yet keep_prefix says it kept a prefix")
        return "not declared (the engine never asks for it); keep_prefix refuses"
    a = prompt(backend)
    _, reply = reference(backend, a)
    cases = {
        "next turn": (a + reply + prompt(backend, 16, variant=2), len(a) + len(reply) - 1),
        "shorter prompt": (a[:20] + prompt(backend, 8, variant=3), 20),
        "shares nothing": (prompt(backend, 24, variant=4), 0),
    }
    gaps = []
    for label, (ids, keep) in cases.items():
        cold_first, cold_tokens = reference(backend, ids)
        # Slot 0 as a finished turn leaves it: the prompt, then the reply but its last token.
        greedy_decode(backend, 0, prefill(backend, 0, a), len(a), GREEDY_STEPS)
        expect(backend.keep_prefix(0, keep), f"{label}: keep_prefix(0, {keep}) refused on a backend declaring prefix_reuse")
        first = prefill(backend, 0, ids, chunks_of(len(ids) - keep, max(1, backend.capabilities.max_batch_tokens)),
                        start=keep)
        tokens = greedy_decode(backend, 0, first, len(ids), GREEDY_STEPS)
        free_all(backend)
        gap = logit_gap(cold_first, first)
        expect(gap <= LOGIT_TOL, f"{label}: reusing {keep} tokens changed the logits by {gap:.2e} of their spread")
        expect(tokens == cold_tokens, f"{label}: greedy tokens {tokens} with reuse vs {cold_tokens} cold")
        gaps.append(gap)
    return f"next turn, shorter prompt, no common prefix: logit gap <= {max(gaps):.1e}; greedy tokens equal"


def check_cut_steps(backend: Backend) -> str | None:
    """A step cut at its deadline writes nothing: run again, it gives the uncut logits."""
    ids = prompt(backend)
    whole, ref_tokens = reference(backend, ids)
    half = max(1, len(ids) // 2)
    prefill(backend, 0, ids[:half])
    rest = StepPlan(prefills=[PrefillChunk(0, ids[half:], half, True)])
    cut = backend.step_within(rest, 0.0)
    expect(cut.cut and not cut.logits, f"step_within(plan, 0) returned cut={cut.cut} with {len(cut.logits)} logits rows")
    backend.cut_step()  # no step under step_within: must not reach the next one
    again = backend.step_within(rest, 60.0)  # a deadline it meets: runs whole
    expect(not again.cut, "a step within a 60 s deadline was cut (or a cut_step() before it reached it)")
    tokens = greedy_decode(backend, 0, again.logits[0], len(ids), GREEDY_STEPS)
    free_all(backend)
    gap = logit_gap(whole, again.logits[0])
    expect(gap <= LOGIT_TOL, f"after a cut the step's logits differ by {gap:.2e} of their spread")
    expect(tokens == ref_tokens, f"greedy tokens after a cut step {tokens} vs never cut {ref_tokens}")
    return f"a cut step left the cache as before: logit gap {gap:.1e}; {GREEDY_STEPS} greedy tokens equal"


def check_completion_timing(backend: Backend) -> str:
    caps = backend.capabilities
    expect(caps.timing in (TIMING_SYNC_WALL, TIMING_OUTPUT_READY, TIMING_DEVICE_EVENT), f"unknown timing kind {caps.timing!r}")
    free_all(backend)
    ids = prompt(backend, 16)
    first = prefill(backend, 0, ids)
    big_n = min(caps.max_batch_tokens - 1, 128, caps.context_per_sequence - len(ids) - 16)
    filler = (prompt(backend) * (big_n // PROMPT_LEN + 1))[:big_n]
    token, small, big, walls = int(np.argmax(first)), [], [], []
    for i in range(3):
        pos = len(ids) + i
        t0 = time.perf_counter()
        r = backend.step(StepPlan(decodes=[DecodeItem(0, token, pos)]))
        walls.append(time.perf_counter() - t0)
        small.append(r.duration_s)
        kept = r.logits[0].copy()
        backend.free_sequence(1)
        t0 = time.perf_counter()
        rb = backend.step(StepPlan(prefills=[PrefillChunk(1, filler, 0, True)]))
        wall_big = time.perf_counter() - t0
        big.append(rb.duration_s)
        expect(0 < rb.duration_s <= wall_big * 1.01 + 1e-4,
               f"a {big_n}-token step reported {rb.duration_s * 1e3:.2f} ms but the call took {wall_big * 1e3:.2f} ms")
        expect(rb.duration_s >= 0.5 * wall_big,
               f"a {big_n}-token step reported {rb.duration_s * 1e3:.2f} ms of a {wall_big * 1e3:.2f} ms call: launch time, not completion?")
        expect(np.array_equal(kept, r.logits[0]), "returned logits changed after a later step (they alias a buffer)")
        expect(np.all(np.isfinite(rb.logits[1])) and rb.logits[1].shape == (caps.vocab_size,), "big step's logits are not final and finite")
    free_all(backend)
    s, b = float(np.median(small)), float(np.median(big))
    expect(all(0 < d <= w * 1.01 + 1e-4 for d, w in zip(small, walls)), "a decode reported more time than its call took, or none")
    expect(b > 1.5 * s, f"a {big_n}-token step reported {b * 1e3:.2f} ms, a 1-token step {s * 1e3:.2f} ms: not completion time")
    return f"1 token {s * 1e3:.2f} ms, {big_n} tokens {b * 1e3:.2f} ms (median of 3); duration within the call; logits final"


def check_capabilities(backend: Backend) -> str:
    caps = backend.capabilities
    expect(caps.owned_loop, "the suite is for owned-loop adapters (owned_loop=False)")
    expect(caps.max_sequences >= 1 and caps.max_batch_tokens >= 1 and caps.context_per_sequence >= PROMPT_LEN + 2 * GREEDY_STEPS,
           f"implausible limits: {caps}")
    free_all(backend)
    ids = prompt(backend, 8)
    logits = prefill(backend, 0, ids)
    expect(logits.shape == (caps.vocab_size,), f"logits have shape {logits.shape}, vocab_size is {caps.vocab_size}")
    if caps.max_sequences >= 2:
        mixed = StepPlan(decodes=[DecodeItem(0, int(np.argmax(logits)), len(ids))],
                         prefills=[PrefillChunk(1, ids, 0, True)])
        if caps.multi_sequence:
            r = backend.step(mixed)
            expect(set(r.logits) == {0, 1}, f"a two-sequence step returned logits for {sorted(r.logits)}")
        else:
            try:
                backend.step(mixed)
            except (BackendError, ValueError):
                pass
            else:
                raise CheckFailed("multi_sequence=False, yet a two-sequence plan ran without an error")
    free_all(backend)
    concurrent = _engine_two_requests(backend)
    mode = "batched in one step" if caps.multi_sequence else "time-sliced by the scheduler"
    return f"limits consistent; two concurrent requests served ({mode}) with their solo outputs: {concurrent}"


def _engine_two_requests(backend: Backend) -> str:
    """The real engine serves two requests at once exactly as it serves each alone."""
    from dlfp.assembly import build_engine
    from dlfp.profiles import load_profile
    from dlfp.sequence import Request

    prompts = [prompt(backend, 24), prompt(backend, 24, variant=1)]

    def run(batch: list[list[int]]) -> list[list[int]]:
        engine = build_engine(backend, "unbounded", load_profile("cpu-laptop"), probe_period_s=None)
        handles = [engine.submit(Request(p, GREEDY_STEPS, ignore_eos=True)) for p in batch]
        records = [h.result(timeout=120) for h in handles]
        engine.shutdown()
        expect(all(r.ok for r in records), f"engine errors: {[r.error for r in records]}")
        return [r.output_ids for r in records]

    solo = [run([p])[0] for p in prompts]
    together = run(prompts)
    expect(together == solo, f"outputs together {together} differ from alone {solo}")
    return "equal"


def check_bad_input(backend: Backend) -> str:
    caps = backend.capabilities
    free_all(backend)
    ids = prompt(backend, 8)
    ctx = caps.context_per_sequence
    cases = {
        "token id = vocab_size": StepPlan(prefills=[PrefillChunk(0, ids[:-1] + [caps.vocab_size], 0, True)]),
        "negative token id": StepPlan(prefills=[PrefillChunk(0, [-1] + ids[1:], 0, True)]),
        "chunk past the context": StepPlan(prefills=[PrefillChunk(0, ids[:4], ctx - 2, True)]),
        "decode at the context end": StepPlan(decodes=[DecodeItem(0, ids[0], ctx)]),
        "step over max_batch_tokens": StepPlan(prefills=[PrefillChunk(0, (ids * (caps.max_batch_tokens // 8 + 2))[: caps.max_batch_tokens + 1], 0, True)]),
        "slot past max_sequences": StepPlan(prefills=[PrefillChunk(caps.max_sequences, ids, 0, True)]),
    }
    for label, plan in cases.items():
        try:
            backend.step(plan)
        except (BackendError, ValueError) as exc:
            expect(bool(str(exc).strip()), f"{label}: the error has no message")
        else:
            raise CheckFailed(f"{label}: no error")
        free_all(backend)
        logits = prefill(backend, 0, ids)  # still serving after the refusal
        expect(np.all(np.isfinite(logits)), f"after {label}: the backend returns broken logits")
        free_all(backend)
    return f"{len(cases)} bad plans refused with a clear error; the backend kept serving"


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Backend], str | None]  # the detail line; None: not applicable
    # The declared capability without which the check is skipped, not run (multi_sequence=False:
    # the capabilities check covers the refusal; no cut_steps: the engine never cuts a step).
    needs: str | None = None

    def applies_to(self, caps: Capabilities) -> bool:
        """Whether this check tests anything on an adapter that declares `caps`."""
        return self.needs is None or bool(getattr(caps, self.needs))


CHECKS: list[Check] = [
    Check("chunked_prefill", check_chunked_prefill),
    Check("riding_chunk", check_riding_chunk, needs="multi_sequence"),
    Check("isolation", check_isolation),
    Check("prefix_reuse", check_prefix_reuse),
    Check("cut_steps", check_cut_steps, needs="cut_steps"),
    Check("completion_timing", check_completion_timing),
    Check("capabilities", check_capabilities),
    Check("bad_input", check_bad_input),
]


def run_check(check: Check, backend: Backend) -> CheckResult:
    """One check; a failed expectation is a fail, any other exception too (with its type)."""
    if not check.applies_to(backend.capabilities):
        return CheckResult(check.name, SKIP, "not applicable to the declared capabilities")
    try:
        detail = check.run(backend)
    except CheckFailed as exc:
        return CheckResult(check.name, FAIL, str(exc))
    except Exception as exc:  # the suite reports a crash instead of stopping
        return CheckResult(check.name, FAIL, f"{type(exc).__name__}: {exc}")
    finally:
        try:
            free_all(backend)
        except Exception:
            pass
    if detail is None:
        return CheckResult(check.name, SKIP, "not applicable to the declared capabilities")
    return CheckResult(check.name, PASS, detail)


def run_all(factory: Callable[[], Backend], checks: list[Check] | None = None) -> list[CheckResult]:
    backend = factory()
    try:
        return [run_check(c, backend) for c in (checks or CHECKS)]
    finally:
        backend.close()


@click.command("check-backend")
@click.argument("name")
@click.option("--model", type=str, default=None, help="Model file (default: the backend's default).")
@click.option("--profile", default="cpu-laptop", show_default=True, help="Device profile name or TOML path.")
@click.option("--threads", type=int, default=None, help="CPU threads (default: physical cores).")
def check_backend_command(name: str, model: str | None, profile: str, threads: int | None) -> None:
    """Run the conformance suite against backend NAME."""
    from dlfp.cli import get_profile, open_backend

    prof = get_profile(profile)
    backend = open_backend(name, model, prof, threads)
    click.echo(f"backend {name}: {backend.capabilities}")
    t0 = time.perf_counter()
    results = run_all(lambda: backend)
    for r in results:
        click.echo(f"{r.status.upper():4}  {r.name:18} {r.detail}")
    failed = [r for r in results if not r.ok]
    click.echo(f"{len(results) - len(failed)}/{len(results)} checks passed in {time.perf_counter() - t0:.1f} s")
    if failed:
        raise SystemExit(1)
