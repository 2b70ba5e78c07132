"""DLFP inside vLLM: scheduler subclasses that cap the prefill of steps that also decode.

Use with `vllm serve MODEL --scheduler-cls dlfp.backends.vllm.scheduler.DLFPAsyncScheduler`
(async scheduling, vLLM's default) or `...DLFPScheduler` with `--no-async-scheduling`.
Parameters come from `--additional-config '{"dlfp": {...}}'` or `DLFP_*` environment
variables (see `settings.py`). The scheduler lives in vLLM's engine core, once per
engine, so tensor parallelism (`--tensor-parallel-size 2`) needs nothing more.

What one `schedule()` does, while any running request is decoding:

1. ask the policy for the cap c (total prompt tokens of the step, all requests together);
2. put decoding requests first in `running` (stable), and lower vLLM's step token
   budget `max_num_scheduled_tokens` to (decode tokens + c): decodes take their
   tokens first, then running prefill chunks and newly admitted prompts share c.
   Under FCFS vLLM preempts from the tail of `running` when KV blocks run out, so
   the order is changed only when the free blocks cover everything the step could
   allocate; otherwise vLLM's order stands (vLLM preempts what it would have
   preempted, and a prefill chunk ahead of a decode may take the budget first);
3. call vLLM's own `schedule()`;
4. restore the budget and the order of `running` (survivors in their old order,
   requests vLLM admitted this step appended, as vLLM appends them).

When nobody decodes, nothing is touched: an isolated prefill gets vLLM's budget.
Pipeline parallelism is refused: there a decode in flight or staggered
(`next_decode_eligible_step`) leaves every other `schedule()` with no decode to
see, so the policy would reset and those steps get the full budget.
`long_prefill_token_threshold` and the encoder budget are left as configured: the
step budget alone bounds the total.

Observation and the async lag: see `dlfp/observer.py` (the same observer the owned-loop engine uses). Under async scheduling an
observation reaches the cap of the step after next at the earliest; each step is
stamped with the cap it ran with and the policy scales that cap.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from dlfp.backends.vllm.version import check_vllm_version

check_vllm_version()  # before touching vLLM internals: a clear message, not an AttributeError

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from dlfp.observer import StepObserver, plan_shape  # noqa: E402
from dlfp.backends.vllm.settings import settings_from  # noqa: E402
from dlfp.policy import StepShape
from dlfp.trace import StepRecord  # noqa: E402


class _DLFPMixin:
    """The DLFP part shared by both scheduler classes; vLLM's class follows it in the MRO."""

    # Injected by tests; perf_counter is CLOCK_MONOTONIC on Linux, comparable across processes.
    clock = staticmethod(time.perf_counter)
    _async: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pp = int(getattr(self.vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
        if pp > 1:
            raise ValueError(
                f"{type(self).__name__} does not support pipeline parallelism (pipeline_parallel_size={pp}): "
                "with decodes in flight on other stages, most steps would see no decode and run uncapped; "
                "use tensor parallelism (--tensor-parallel-size) instead"
            )
        mode = bool(self.scheduler_config.async_scheduling)
        if mode != self._async:
            other = "DLFPAsyncScheduler" if mode else "DLFPScheduler"
            raise ValueError(
                f"{type(self).__name__} needs async scheduling {'on' if self._async else 'off'}, but vLLM has it "
                f"{'on' if mode else 'off'}: use --scheduler-cls dlfp.backends.vllm.scheduler.{other}"
            )
        self.dlfp_settings = settings_from(self.vllm_config.additional_config)
        self.dlfp_policy = self.dlfp_settings.make_policy()
        self._trace_file = open(self.dlfp_settings.step_trace, "a") if self.dlfp_settings.step_trace else None
        self.dlfp = StepObserver(self.dlfp_policy, lambda: self.clock(), self._write_step)
        self._stamped: dict[int, SchedulerOutput] = {}  # keeps stamped outputs alive so ids stay unique

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        decodes = {r.request_id: n for r in self.running if (n := self._decode_tokens(r)) > 0}
        # A chunked prompt's next chunk starts where it stopped; a waiting prompt is not running yet
        # (its cached prefix is known only once scheduled): None, priced at position 0.
        position = next((r.num_computed_tokens for r in self.running
                         if r.request_id not in decodes and r.num_computed_tokens < r.num_prompt_tokens), None)
        cap = self.dlfp.begin(guarded=bool(decodes), n_decode=len(decodes), position=position)
        if cap is None:
            out = super().schedule(*args, **kwargs)
        else:
            out = self._capped_schedule(sum(decodes.values()) + cap, decodes, args, kwargs)
        self.dlfp.scheduled(id(out), bool(decodes), cap, self._shape(out, decodes))
        self._stamped[id(out)] = out
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput):
        self.dlfp.completed(id(scheduler_output))  # clock first: the output is back now
        self._stamped.pop(id(scheduler_output), None)
        return super().update_from_output(scheduler_output, model_runner_output)

    def shutdown(self) -> None:
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None
        super().shutdown()

    def _capped_schedule(self, budget: int, decodes: dict[str, int], args: tuple, kwargs: dict) -> SchedulerOutput:
        saved_budget, order = self.max_num_scheduled_tokens, list(self.running)
        self.max_num_scheduled_tokens = min(saved_budget, budget)
        if self._no_preemption_possible(self.max_num_scheduled_tokens):
            self.running.sort(key=lambda r: r.request_id not in decodes)  # stable: decodes first
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = saved_budget
            self._restore_order(order)

    def _no_preemption_possible(self, budget: int) -> bool:
        """True when the free KV blocks cover the most this step can allocate.

        At most `budget` new tokens, plus per running request one block its tokens may
        newly straddle and its lookahead slots, in every KV cache group. A bound, so a
        step that would not have preempted may still keep vLLM's order.
        """
        block = max(1, int(self.block_size))
        per_req = 1 + -(-int(self.num_lookahead_tokens or 0) // block)
        groups = max(1, len(self.kv_cache_config.kv_cache_groups))
        need = (-(-budget // block) + per_req * len(self.running)) * groups
        return self.kv_cache_manager.block_pool.get_num_free_blocks() >= need

    def _restore_order(self, order: list[Request]) -> None:
        rank = {id(r): i for i, r in enumerate(order)}
        kept = sorted((r for r in self.running if id(r) in rank), key=lambda r: rank[id(r)])
        self.running[:] = kept + [r for r in self.running if id(r) not in rank]

    def _shape(self, out: SchedulerOutput, decodes: dict[str, int]) -> "StepShape":
        """What the step carries. vLLM has already advanced `num_computed_tokens` past the
        scheduled tokens, so a request's first scheduled position is computed - scheduled."""
        decode_positions, chunks = [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            start = max(0, req.num_computed_tokens - n) if req is not None else 0
            if rid in decodes:
                decode_positions += [start + i for i in range(n)]  # 1 + speculative tokens
            else:
                chunks.append((start, n))
        return plan_shape(decode_positions, chunks)

    def _decode_tokens(self, r: Request) -> int:
        """Tokens vLLM will schedule for a decoding request this step (0: not decoding).

        Mirrors the skips at the top of vLLM 0.32's running loop, so the budget
        reserved for decodes is exactly what they take and no more goes to prefill.
        """
        if r.is_prefill_chunk:
            return 0
        if r.num_output_placeholders > 0 and (
            r.num_computed_tokens + 2 - r.num_output_placeholders >= r.num_prompt_tokens + r.max_tokens
        ):
            return 0  # async: the step in flight already reaches max_tokens
        if self.current_step + 1 < r.next_decode_eligible_step:
            return 0  # pipeline-parallel decode stagger (schedule() increments current_step)
        n = r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
        return max(0, min(n, self.max_model_len - r.num_computed_tokens - self.num_sampled_tokens_per_step))

    def _write_step(self, rec: StepRecord) -> None:
        if self._trace_file is not None:
            self._trace_file.write(json.dumps(asdict(rec)) + "\n")
            self._trace_file.flush()


class DLFPScheduler(_DLFPMixin, Scheduler):
    """DLFP over vLLM's synchronous scheduler (`--no-async-scheduling`)."""

    _async = False


class DLFPAsyncScheduler(_DLFPMixin, AsyncScheduler):
    """DLFP over vLLM's async scheduler (vLLM's default)."""

    _async = True


def scheduler_class_name(async_scheduling: bool) -> str:
    """The `--scheduler-cls` value for a given async-scheduling setting."""
    cls = DLFPAsyncScheduler if async_scheduling else DLFPScheduler
    return f"{cls.__module__}.{cls.__qualname__}"
