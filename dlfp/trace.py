"""What a run leaves behind: one record per step and one per request, as JSONL.

Times are seconds on the engine's monotonic clock (`time.perf_counter`); files
store them relative to the trace origin so runs can be compared.
"""
from __future__ import annotations

import gzip
import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path


# Why a step was cut (StepRecord.cut_by).
DEADLINE = "deadline"  # a guarded step still running at its decision's deadline
CONTENTION = "contention"  # a guarded step on several threads that another program started to slow
ARRIVAL = "arrival"  # a background step a foreground request arrived behind


def is_capped(guarded: bool, cap: int | None, n_prefill: int) -> bool:
    """The policy's cap governed a step: a protected sequence decoded, a cap was in
    force and prompt tokens joined. The steps a policy observes; decided here only."""
    return guarded and cap is not None and n_prefill > 0


@dataclass
class StepRecord:
    t0: float
    t1: float
    duration_s: float  # completed step time as the backend measured it
    n_decode: int
    n_prefill_fg: int
    n_prefill_bg: int
    guarded: bool
    cap: int | None
    bg_cap: int | None
    observed_s: float | None = None  # what the policy was fed after this step (None: nothing)
    unreachable: bool = False
    device_duration_s: float | None = None
    governor: str | None = None  # thermal governor decision, when one runs
    threads: int | None = None  # the backend's step threads, where dlfp controls them
    n_decode_held: int = 0  # background decodes a guarded step's cap kept waiting
    # The decision record of a guarded step (dlfp.policy.Decision): why it has its cap.
    rule: str | None = None
    predicted_ms: float | None = None  # the cost model's time for the planned step
    margin: float | None = None  # measured / predicted quantile applied to the prediction
    setpoint_ms: float | None = None  # target / margin
    cut_ms: float | None = None  # the decision's deadline for a step with prompt tokens
    position: int | None = None  # where the planned chunk starts
    decode_ms: float | None = None  # the cost model's time for the step's decodes alone
    n_prefill_cut: int = 0  # prompt tokens of a step that was cut (none of them ran)
    cut_by: str | None = None  # why it was cut: DEADLINE, CONTENTION or ARRIVAL

    @property
    def capped(self) -> bool:
        return is_capped(self.guarded, self.cap, self.n_prefill_fg + self.n_prefill_bg)


@dataclass
class RequestRecord:
    request_id: str
    priority: str
    tag: str
    arrival_s: float
    prompt_len: int
    output_ids: list[int]
    token_times: list[float]
    finish_reason: str | None
    error: str | None
    finished_s: float | None
    n_prefill_chunks: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens reused from a cached prefix (not computed)
    preemptions: int = 0  # times a background request gave its slot to a conversation and started over
    itl_target_s: float | None = None  # the request's own goals, where it named them
    ttft_goal_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Trace:
    origin: float
    steps: list[StepRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # probe readings
    notes: list[str] = field(default_factory=list)  # e.g. "target unreachable"
    max_threads: int | None = None  # the backend's full step threads, where dlfp controls them
    slot_evictions: dict[str, int] = field(default_factory=dict)  # reason -> count (dlfp.prefix_cache)
    steps_dropped_until: float | None = None  # the end of the latest step drop_oldest dropped
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_step(self, rec: StepRecord) -> None:
        with self._lock:
            self.steps.append(rec)

    def add_request(self, rec: RequestRecord) -> None:
        with self._lock:
            self.requests.append(rec)

    def add_sample(self, sample: dict) -> None:
        with self._lock:
            self.samples.append(sample)

    def steps_since(self, t: float) -> list[StepRecord]:
        """The kept steps that began at `t` (engine clock) or later."""
        with self._lock:
            return [s for s in self.steps if s.t0 >= t]

    def drop_oldest(self, keep_steps: int, keep_others: int) -> None:
        """Keep only the latest records (a server that runs for days); `steps_dropped_until`
        says up to when steps were dropped, so a reader knows what it is missing."""
        with self._lock:
            for records, keep in ((self.steps, keep_steps), (self.requests, keep_others), (self.samples, keep_others)):
                if len(records) > 2 * keep:
                    if records is self.steps:
                        self.steps_dropped_until = records[-keep - 1].t1
                    del records[:-keep]

    def note(self, text: str) -> None:
        with self._lock:
            if text not in self.notes:
                self.notes.append(text)

    def write(self, directory: Path, suffix: str) -> dict[str, Path]:
        """Write steps-, requests- (and samples-) JSONL files; returns their paths."""
        directory.mkdir(parents=True, exist_ok=True)
        paths = {
            "steps": directory / f"steps-{suffix}.jsonl",
            "requests": directory / f"requests-{suffix}.jsonl",
        }
        o = self.origin
        with self._lock:
            _write_jsonl(paths["steps"], (step_row(s, o) for s in self.steps))
            _write_jsonl(
                paths["requests"],
                (_shift_request(asdict(r), o) for r in self.requests),
            )
            if self.samples:
                paths["samples"] = directory / f"samples-{suffix}.jsonl"
                _write_jsonl(paths["samples"], (_shift(dict(s), o, ("t",)) for s in self.samples))
        return paths


def step_row(step: StepRecord, origin: float) -> dict:
    """A step as a trace row, its times relative to `origin`."""
    return _shift(asdict(step), origin, ("t0", "t1"))


def step_from_row(row: dict, origin: float = 0.0) -> StepRecord:
    """A trace row as a step, its times relative to `origin`; keys the record lacks (written
    by a newer version) are skipped."""
    return _record(StepRecord, _shift(dict(row), origin, ("t0", "t1")))


def _record(record: type, row: dict):
    fields = record.__dataclass_fields__
    return record(**{k: v for k, v in row.items() if k in fields})


def _shift(d: dict, origin: float, keys: tuple[str, ...]) -> dict:
    for k in keys:
        if d.get(k) is not None:
            d[k] = d[k] - origin
    return d


def _shift_request(d: dict, origin: float) -> dict:
    _shift(d, origin, ("arrival_s", "finished_s"))
    d["token_times"] = [t - origin for t in d["token_times"]]
    return d


def _write_jsonl(path: Path, rows) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_requests(path: Path) -> list[RequestRecord]:
    return _read(Path(path), RequestRecord)


def read_steps(path: Path) -> list[StepRecord]:
    return _read(Path(path), StepRecord)


def _read(path: Path, record: type) -> list:
    """A JSONL trace, or its gzip copy (a kept run keeps only those); keys the record lacks
    (written by a newer version) are skipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [_record(record, json.loads(line)) for line in f if line.strip()]


def control_counts(steps: list[StepRecord], max_threads: int | None) -> dict:
    """How often the runtime's controls acted: guarded steps kept free of background
    prompt tokens (a cap of 0), steps cut for a foreground arrival or another program's
    contention, and steps run on fewer than the backend's `max_threads`."""
    return {
        "zero_cap_steps": sum(1 for s in steps if s.guarded and s.cap == 0),
        "bg_steps_cut": sum(1 for s in steps if s.cut_by == ARRIVAL),
        "steps_cut_for_contention": sum(1 for s in steps if s.cut_by == CONTENTION),
        "reduced_thread_steps": sum(1 for s in steps if None not in (s.threads, max_threads) and s.threads < max_threads),
    }


def rule_counts(steps: list[StepRecord]) -> dict[str, int]:
    """Guarded steps per decision rule (dlfp.policy.RULES): which rule set the cap how often."""
    counts: dict[str, int] = {}
    for s in steps:
        if s.guarded and s.rule is not None:
            counts[s.rule] = counts.get(s.rule, 0) + 1
    return dict(sorted(counts.items()))
