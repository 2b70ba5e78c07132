"""`dlfp bench --overhead`: is the runtime itself cheap enough?

1. Decode speed: one request's decode tokens per second through dlfp's engine
   against llama-cpp-python's own generation loop (`Llama.generate`, greedy) on
   the same model file, threads, batch size and per-sequence context, as a
   ratio. Runs alternate (engine, llama, engine, ...) and the medians compare.
   The llama-cpp-python loop runs in a fresh child process: a second llama.cpp
   context computing on another thread of the same process slows the engine
   thread's decodes (their CPU thread pools compete), which would charge the
   runtime for the measurement's own reference.
2. Controller + scheduler share: in a DLFP run where a background prompt is
   capped beside a foreground decode, the time spent in the policy (cap,
   observe, reset) and the scheduler (admit, plan) per step, as a share of the
   step's wall time. Measured by wrapping those methods on the engine's own
   instances; the engine is not modified.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time
from typing import Callable

from dlfp.protocol import Backend
from dlfp.assembly import build_engine
from dlfp.sequence import BACKGROUND, FOREGROUND, Request
from dlfp.workloads.tokens import make_prompts


class OverheadError(RuntimeError):
    pass


def measure_overhead(
    backend: Backend, profile, itl_target_ms: float | None = None,
    prompt_len: int = 32, n_tokens: int = 128, repeats: int = 3,
) -> dict:
    caps = backend.capabilities
    prompt = make_prompts([prompt_len], caps.vocab_size, seed=0)[0]
    engine_rates, llama_rates, outputs = [], [], {}
    for _ in range(repeats):
        rate, outputs["engine"] = _engine_decode(backend, profile, prompt, n_tokens)
        engine_rates.append(rate)
        rate, outputs["llama"] = _llama_in_subprocess(backend, prompt, n_tokens)
        llama_rates.append(rate)
    engine_med, llama_med = statistics.median(engine_rates), statistics.median(llama_rates)
    return {
        "decode": {
            "prompt_tokens": prompt_len,
            "output_tokens": n_tokens,
            "engine_tok_s": engine_rates,
            "llama_cpp_python_tok_s": llama_rates,
            "engine_median_tok_s": engine_med,
            "llama_cpp_python_median_tok_s": llama_med,
            "ratio": engine_med / llama_med,
            "same_tokens": outputs["engine"] == outputs["llama"],
        },
        "control": _control_share(backend, profile, itl_target_ms),
        "backend": backend.describe(),
    }


def _load_llama(job: dict):
    """llama_cpp.Llama with the backend's settings, extra buffer types off as in the backend."""
    import llama_cpp
    import llama_cpp.llama_cpp as raw

    original = raw.llama_model_default_params

    def params_without_extra_buffers():
        mp = original()
        mp.use_extra_bufts = job["extra_buffers"]  # the AMX repack path crashes multi-token batches here
        return mp

    raw.llama_model_default_params = params_without_extra_buffers
    try:
        return llama_cpp.Llama(
            model_path=job["model_path"],
            n_ctx=job["n_ctx"],
            n_batch=job["n_batch"],
            n_ubatch=job["n_batch"],
            n_threads=job["n_threads"],
            n_threads_batch=job["n_threads"],
            flash_attn=job["flash_attn"],  # the same attention kernels as the backend
            verbose=False,
        )
    except ValueError as exc:
        raise OverheadError(f"llama-cpp-python could not load {job['model_path']}: {exc}") from None
    finally:
        raw.llama_model_default_params = original


def _decode_rate(times: list[float]) -> float:
    """Tokens per second after the first token (the first comes from the prefill)."""
    if len(times) < 2 or times[-1] <= times[0]:
        raise OverheadError("too few tokens to time the decode")
    return (len(times) - 1) / (times[-1] - times[0])


def _engine_decode(backend, profile, prompt: list[int], n_tokens: int) -> tuple[float, list[int]]:
    engine = build_engine(backend, "unbounded", profile, probe_period_s=None)
    try:
        record = engine.submit(Request(prompt, n_tokens, FOREGROUND, ignore_eos=True)).result(timeout=600)
    finally:
        engine.shutdown(abort_pending=True)
    if not record.ok:
        raise OverheadError(f"engine request failed: {record.error}")
    return _decode_rate(record.token_times), record.output_ids


def _llama_decode(llm, prompt: list[int], n_tokens: int) -> tuple[float, list[int]]:
    llm.reset()
    times, ids = [], []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        times.append(time.perf_counter())
        ids.append(token)
        if len(ids) >= n_tokens:
            break
    return _decode_rate(times), ids


def _llama_in_subprocess(backend, prompt: list[int], n_tokens: int) -> tuple[float, list[int]]:
    job = {"model_path": backend.config.model_path, "extra_buffers": backend.config.extra_buffers,
           "flash_attn": backend.config.flash_attn,
           "n_ctx": backend.capabilities.context_per_sequence, "n_batch": backend.capabilities.max_batch_tokens,
           "n_threads": backend.n_threads, "prompt": prompt, "n_tokens": n_tokens}
    done = subprocess.run([sys.executable, "-m", "dlfp.bench.overhead"], input=json.dumps(job),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise OverheadError(f"llama-cpp-python reference failed: {done.stderr.strip()[-500:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["rate"], out["ids"]


def _reference_main() -> None:
    """Child process: llama-cpp-python's own loop on the job read from stdin."""
    job = json.loads(sys.stdin.read())
    llm = _load_llama(job)
    try:
        rate, ids = _llama_decode(llm, job["prompt"], job["n_tokens"])
    finally:
        llm.close()
    print(json.dumps({"rate": rate, "ids": ids}))


class _Stopwatch:
    def __init__(self) -> None:
        self.pending = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.pending += time.perf_counter() - t0

        return timed

    def take(self) -> float:
        t, self.pending = self.pending, 0.0
        return t


def _control_share(backend, profile, itl_target_ms: float | None) -> dict:
    caps = backend.capabilities
    engine = build_engine(backend, "dlfp", profile, itl_target_ms=itl_target_ms, probe_period_s=None, start=False)
    watch = _Stopwatch()
    for obj, names in ((engine.scheduler, ("admit", "plan")), (engine.policy, ("cap", "observe", "reset"))):
        for name in names:
            setattr(obj, name, watch.wrap(getattr(obj, name)))
    if engine.preemption is not None:
        for name in ("cap", "observe"):
            setattr(engine.preemption, name, watch.wrap(getattr(engine.preemption, name)))
    shares, control = [], []

    def on_step(rec) -> None:
        spent = watch.take()
        control.append(spent)
        shares.append(spent / (rec.t1 - rec.t0 + spent))

    engine.step_hooks.append(on_step)
    fg_prompt, bg_prompt = make_prompts([32, min(512, caps.context_per_sequence - 16)], caps.vocab_size, seed=1)
    engine.start()
    with contextlib.ExitStack() as stack:
        stack.callback(engine.shutdown, abort_pending=True)
        fg = engine.submit(Request(fg_prompt, 96, FOREGROUND, ignore_eos=True, request_id="fg"))
        bg = engine.submit(Request(bg_prompt, 4, BACKGROUND, ignore_eos=True, request_id="bg"))
        fg.result(timeout=600)
        bg.result(timeout=600)
    capped = [s for s in engine.trace.steps if s.capped]
    return {
        "steps": len(shares),
        "capped_steps": len(capped),
        "control_us_per_step_mean": 1e6 * statistics.fmean(control) if control else None,
        "control_us_per_step_max": 1e6 * max(control) if control else None,
        "share_of_step_mean": statistics.fmean(shares) if shares else None,
        "share_of_step_max": max(shares) if shares else None,
        "engine_share_of_step_mean": statistics.fmean(
            [(s.t1 - s.t0 - s.duration_s) / (s.t1 - s.t0) for s in engine.trace.steps if s.t1 > s.t0]
        ) if engine.trace.steps else None,
    }


def print_overhead(result: dict, console) -> None:
    d, c = result["decode"], result["control"]
    console.print(
        f"decode, one request ({d['prompt_tokens']} in / {d['output_tokens']} out): dlfp engine "
        f"{d['engine_median_tok_s']:.1f} tok/s vs llama-cpp-python {d['llama_cpp_python_median_tok_s']:.1f} tok/s: "
        f"ratio {d['ratio']:.3f} (goal >= 0.95); same tokens: {d['same_tokens']}"
    )
    console.print(
        f"controller + scheduler: {c['control_us_per_step_mean']:.0f} us per step on average "
        f"({c['share_of_step_mean'] * 100:.2f}% of the step, max {c['share_of_step_max'] * 100:.2f}%) over "
        f"{c['steps']} steps ({c['capped_steps']} capped); the whole engine outside llama_decode: "
        f"{c['engine_share_of_step_mean'] * 100:.2f}% of a step"
    )


if __name__ == "__main__":
    _reference_main()
