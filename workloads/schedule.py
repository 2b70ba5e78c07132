"""One seed's run plan: which request arrives when, with which exact tokens.

Every policy of a seed gets the identical plan; its fingerprint proves it.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlfp.sequence import Request, SamplingParams
from dlfp.workloads.arrivals import arrival_times
from dlfp.workloads.specs import WorkloadSpec
from dlfp.workloads.tokens import fingerprint, make_prompts

WARMUP_TAG = "warmup"


@dataclass(frozen=True)
class PlannedRequest:
    request_id: str
    arrival_s: float  # from the start of the measured run (warmups: 0, run one by one before it)
    prompt_ids: tuple[int, ...]
    max_tokens: int
    priority: str
    tag: str  # the class label, or "warmup"

    def to_request(self) -> Request:
        """A fresh engine request: greedy, output length forced (EOS ignored) for exact accounting."""
        return Request(
            list(self.prompt_ids),
            self.max_tokens,
            self.priority,
            sampling=SamplingParams(temperature=0.0),
            ignore_eos=True,
            request_id=self.request_id,
            tag=self.tag,
        )


@dataclass(frozen=True)
class Schedule:
    seed: int
    warmup: tuple[PlannedRequest, ...]
    measured: tuple[PlannedRequest, ...]  # sorted by arrival
    fingerprint: str
    # (start, stop) of the busy neighbour process, seconds from the start of the measured run
    neighbour_s: tuple[float, float] | None = None

    @property
    def expected_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.measured)


def build_schedule(
    spec: WorkloadSpec, seed: int, vocab_size: int, burstiness: float = 1.0, pool: list[int] | None = None
) -> Schedule:
    """`pool`: tokenized text to cut prompts from (see tokens.py); None: random ids."""
    fg = spec.foreground
    shapes: list[tuple[str, str, str, int, int, float]] = [
        (f"warmup-{i}", fg.priority, WARMUP_TAG, fg.input_len, fg.output_len, 0.0) for i in range(spec.warmup)
    ]
    for k, cls in enumerate(spec.classes):
        # Each class has its own stream, seeded by (seed, class index): independent and repeatable.
        times = arrival_times(cls.count, cls.rate, [seed, k], burstiness)
        shapes += [(f"{cls.label}-{i}", cls.priority, cls.label, cls.input_len, cls.output_len, t)
                   for i, t in enumerate(times)]
    prompts = make_prompts([s[3] for s in shapes], vocab_size, seed, spec.shared_prefix, pool)
    planned = [
        PlannedRequest(rid, t, tuple(p), n_out, prio, tag)
        for (rid, prio, tag, _, n_out, t), p in zip(shapes, prompts)
    ]
    warm = tuple(p for p in planned if p.tag == WARMUP_TAG)
    measured = tuple(sorted((p for p in planned if p.tag != WARMUP_TAG), key=lambda p: p.arrival_s))
    # The fingerprint covers every token id, arrival time and output length.
    timing = ";".join(f"{p.request_id}@{p.arrival_s:.6f}/{p.max_tokens}" for p in planned)
    span = measured[-1].arrival_s if measured else 0.0
    neighbour = (span / 3, 2 * span / 3) if spec.neighbour else None
    return Schedule(seed, warm, measured, fingerprint(prompts + [list(timing.encode())]), neighbour)
