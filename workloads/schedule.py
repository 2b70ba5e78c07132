"""One seed's run plan: which request arrives when, with which exact tokens.

Every policy of a seed gets the identical plan; its fingerprint proves it.

A multi-turn session's turns are planned too, but a turn's prompt depends on the
reply the previous turn got, which exists only at run time: a turn carries just
its new message (`prompt_ids`) and think time, and the runner builds the prompt
when it submits the turn: `to_request(history)`, history being the previous
turn's prompt and reply. Everything a seed decides (messages, session arrivals,
think times) is fixed here; with greedy, exact outputs every arm sends the same
prompts, and where an arm's replies differed the agreement check says so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from dlfp.sequence import Request, SamplingParams
from dlfp.workloads.arrivals import arrival_times
from dlfp.workloads.specs import Goals, WorkloadSpec
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
    session: str = ""  # multi-turn: the session's id ("" for a single request)
    turn: int = 0  # multi-turn: the turn's index in its session
    think_s: float = 0.0  # multi-turn: pause between the previous reply and this message (turn 0: none)
    goals: Goals | None = None  # its own latency goals, sent with it (None: the run's defaults)

    def to_request(self, history: list[int] | tuple[int, ...] = (), cache_prompt: bool = True) -> Request:
        """A fresh engine request: greedy, output length forced (EOS ignored) for exact accounting.
        `history`: a session turn's previous prompt and reply, which this turn's message extends."""
        return Request(
            list(history) + list(self.prompt_ids),
            self.max_tokens,
            self.priority,
            sampling=SamplingParams(temperature=0.0),
            ignore_eos=True,
            request_id=self.request_id,
            tag=self.tag,
            cache_prompt=cache_prompt,
            itl_target_s=self.goals.itl_target_ms / 1e3 if self.goals and self.goals.itl_target_ms else None,
            ttft_goal_s=self.goals.ttft_s if self.goals else None,
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

    def singles(self) -> tuple[PlannedRequest, ...]:
        """Measured requests submitted at their arrival time (not session turns)."""
        return tuple(p for p in self.measured if not p.session)

    def sessions(self) -> list[tuple[PlannedRequest, ...]]:
        """Each session's turns in order."""
        by: dict[str, list[PlannedRequest]] = {}
        for p in self.measured:
            if p.session:
                by.setdefault(p.session, []).append(p)
        return [tuple(sorted(turns, key=lambda p: p.turn)) for turns in by.values()]


def build_schedule(
    spec: WorkloadSpec, seed: int, vocab_size: int, burstiness: float = 1.0, pool: list[int] | None = None
) -> Schedule:
    """`pool`: tokenized text to cut prompts from (see tokens.py); None: random ids."""
    fg = spec.foreground
    shapes: list[tuple[str, str, str, int, int, float, Goals | None]] = [
        (f"warmup-{i}", fg.priority, WARMUP_TAG, fg.input_len, fg.output_len, 0.0, None) for i in range(spec.warmup)
    ]
    for k, cls in enumerate(spec.classes):
        # Each class has its own stream, seeded by (seed, class index): independent and repeatable.
        times = arrival_times(cls.count, cls.rate, [seed, k], burstiness)
        shapes += [(f"{cls.label}-{i}", cls.priority, cls.label, cls.input_len, cls.output_len, t, cls.goals)
                   for i, t in enumerate(times)]
    turns = _session_turns(spec, seed, len(spec.classes))
    shapes += [(rid, cls.priority, cls.label, n_in, cls.output_len, t, cls.goals) for rid, cls, n_in, t, *_ in turns]
    prompts = make_prompts([s[3] for s in shapes], vocab_size, seed, spec.shared_prefix, pool)
    planned = [
        PlannedRequest(rid, t, tuple(p), n_out, prio, tag, goals=goals)
        for (rid, prio, tag, _, n_out, t, goals), p in zip(shapes, prompts)
    ]
    first_turn = len(shapes) - len(turns)
    for i, (_, _, _, _, session, k, think) in enumerate(turns):
        planned[first_turn + i] = replace(planned[first_turn + i], session=session, turn=k, think_s=think)
    warm = tuple(p for p in planned if p.tag == WARMUP_TAG)
    measured = tuple(sorted((p for p in planned if p.tag != WARMUP_TAG), key=lambda p: (p.arrival_s, p.turn)))
    # The fingerprint covers every token id, arrival time, think time and output length.
    timing = ";".join(f"{p.request_id}@{p.arrival_s:.6f}+{p.think_s:.6f}/{p.max_tokens}" + _goals_key(p.goals)
                      for p in planned)
    span = measured[-1].arrival_s if measured else 0.0
    neighbour = (span / 3, 2 * span / 3) if spec.neighbour else None
    return Schedule(seed, warm, measured, fingerprint(prompts + [list(timing.encode())]), neighbour)


def _goals_key(goals: Goals | None) -> str:
    """The goals' part of the fingerprint ("" without goals, so plans without them keep theirs)."""
    return "" if goals is None else f"~{goals.itl_target_ms}/{goals.ttft_s}"


def _session_turns(spec: WorkloadSpec, seed: int, stream0: int) -> list[tuple]:
    """(request id, class, message length, session arrival, session id, turn, think time) of
    every session turn. Session arrivals are open-loop (one stream per session class, after
    the request classes' streams); think times are drawn uniformly in [0.5, 1.5] x the mean."""
    out = []
    for k, cls in enumerate(spec.sessions):
        starts = arrival_times(cls.count, cls.rate, [seed, stream0 + k], 1.0)
        rng = np.random.default_rng([seed, stream0 + k, 0x7468696E])
        for i, t0 in enumerate(starts):
            thinks = rng.uniform(0.5, 1.5, size=cls.turns) * cls.think_time_s
            for turn in range(cls.turns):
                n_in = cls.first_len if turn == 0 else cls.message_len
                out.append((f"{cls.label}-{i}-t{turn}", cls, n_in, t0, f"{cls.label}-{i}", turn,
                            0.0 if turn == 0 else float(thinks[turn])))
    return out
