"""The standard exact-token workloads, each with its SLO and pass/fail gate.

Chat, RAG, Agent and Decode-heavy are the paper's shapes (input/output tokens)
at the paper's GPU sizes; `scaled()` shrinks every token count by one factor so
the ratios hold on a CPU. The laptop mix and the low-interference case are sized
for a CPU laptop with the default model already. SLOs other than the paper's
Agent SLO are this project's declared choices; `--slo` overrides them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from dlfp.metrics import SLO
from dlfp.sequence import BACKGROUND, FOREGROUND


@dataclass(frozen=True)
class Goals:
    """A foreground request's own latency goals, sent with it (dlfp's request extension) and
    judged per request: TTFT within `ttft_s` and its own P99 ITL within 1.1 x `itl_target_ms`."""

    itl_target_ms: float | None = None
    ttft_s: float | None = None


@dataclass(frozen=True)
class RequestClass:
    label: str  # chat, ingest, ...
    priority: str
    input_len: int
    output_len: int
    count: int  # measured requests of this class
    rate: float  # requests per second of this class's own Poisson stream
    goals: "Goals | None" = None  # each request's own ITL target and TTFT goal (None: the run's defaults)


@dataclass(frozen=True)
class SessionClass:
    """Multi-turn chat sessions: each turn's prompt is the previous turn's prompt, the
    reply it got, and a new user message, so the prompt grows by a reply and a message
    a turn (what a chat app sends). Sessions arrive open-loop; within one, the next
    message comes a think time after the reply."""

    label: str
    priority: str
    first_len: int  # tokens of the first turn's prompt (system prompt and first message)
    message_len: int  # tokens of every later user message
    output_len: int  # reply tokens per turn
    turns: int
    count: int  # sessions
    rate: float  # session arrivals per second
    think_time_s: float  # mean pause between a reply and the next message
    goals: "Goals | None" = None  # every turn's own ITL target and TTFT goal (None: the run's defaults)

    @property
    def max_positions(self) -> int:
        return self.first_len + (self.turns - 1) * self.message_len + self.turns * self.output_len


@dataclass(frozen=True)
class Gate:
    """What a candidate policy must show against the baseline, trial by trial.

    min_reduction set: `metric` falls by at least this fraction in every trial.
    min_reduction None ("do no harm"): the 95% interval of the paired change
    includes zero or lies below it.
    """

    metric: str = "itl_p99_ms"
    min_reduction: float | None = 0.10

    def describe(self) -> str:
        if self.min_reduction is None:
            return f"{self.metric}: paired change not worse (interval includes 0 or favours the candidate)"
        return f"{self.metric}: reduction >= {self.min_reduction:.0%} in every trial"


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str
    classes: tuple[RequestClass, ...]
    slo: SLO
    warmup: int = 3
    gate: Gate = Gate()
    shared_prefix: int = 0  # 0: nonmatching prompts
    scale: float = 1.0
    # A CPU-bound child process competes for a core during the middle third of the
    # measured arrivals (started and stopped by the bench, recorded in the trace).
    neighbour: bool = False
    sessions: tuple[SessionClass, ...] = ()  # multi-turn chats beside the single requests

    @property
    def foreground(self) -> RequestClass:
        """The foreground class (a session class stands in as its first turn)."""
        fg = next((c for c in self.classes if c.priority == FOREGROUND), None)
        if fg is not None:
            return fg
        s = next(c for c in self.sessions if c.priority == FOREGROUND)
        return RequestClass(s.label, s.priority, s.first_len, s.output_len, s.count * s.turns, s.rate)

    @property
    def has_background(self) -> bool:
        return any(c.priority == BACKGROUND for c in self.classes)

    @property
    def max_positions(self) -> int:
        """Context positions the longest request needs."""
        return max([c.input_len + c.output_len for c in self.classes] + [s.max_positions for s in self.sessions])

    def scaled(self, scale: float) -> "WorkloadSpec":
        """Every token count times `scale` (at least 1 token), ratios kept."""
        if not scale > 0:
            raise ValueError(f"--scale must be > 0, got {scale}")

        def s(n: int) -> int:
            return max(1, round(n * scale))

        classes = tuple(replace(c, input_len=s(c.input_len), output_len=s(c.output_len)) for c in self.classes)
        sessions = tuple(replace(c, first_len=s(c.first_len), message_len=s(c.message_len), output_len=s(c.output_len))
                         for c in self.sessions)
        prefix = min(round(self.shared_prefix * scale), min(c.input_len for c in classes) - 1) if classes else 0
        return replace(self, classes=classes, sessions=sessions, shared_prefix=prefix, scale=self.scale * scale)

    def with_load(self, requests: int | None = None, rate: float | None = None) -> "WorkloadSpec":
        """Set the foreground count/rate (sessions, for a multi-turn workload); background
        streams keep their proportion to it."""
        fg = next((c for c in self.sessions if c.priority == FOREGROUND), None) or self.foreground
        n_factor = requests / fg.count if requests is not None else 1.0
        r_factor = rate / fg.rate if rate is not None else 1.0
        if requests is not None and requests < 1:
            raise ValueError(f"--requests must be >= 1, got {requests}")
        if rate is not None and not rate > 0:
            raise ValueError(f"--rate must be > 0, got {rate}")
        classes = tuple(
            replace(c, count=max(1, round(c.count * n_factor)), rate=c.rate * r_factor) for c in self.classes
        )
        sessions = tuple(
            replace(c, count=max(1, round(c.count * n_factor)), rate=c.rate * r_factor) for c in self.sessions
        )
        return replace(self, classes=classes, sessions=sessions)

    def to_dict(self) -> dict:
        return asdict(self)


def _one(label: str, n_in: int, n_out: int, slo: SLO, description: str) -> WorkloadSpec:
    chat = RequestClass(label, FOREGROUND, n_in, n_out, count=100, rate=1.0)
    return WorkloadSpec(label, description, (chat,), slo)


SPECS: dict[str, WorkloadSpec] = {
    "chat": _one("chat", 1024, 128, SLO(2.0, 0.050, 10.0), "paper Chat: 1,024 in / 128 out"),
    "rag": _one("rag", 8192, 256, SLO(4.0, 0.050, 20.0), "paper RAG: 8,192 in / 256 out"),
    # The paper's own Agent SLO: TTFT <= 5 s, mean ITL <= 35 ms, E2E <= 14 s.
    "agent": _one("agent", 16384, 256, SLO(5.0, 0.035, 14.0), "paper Agent: 16,384 in / 256 out"),
    "decode-heavy": _one("decode-heavy", 256, 1024, SLO(1.0, 0.035, 40.0), "paper Decode-heavy: 256 in / 1,024 out"),
    # CPU-sized: a foreground chat while three documents are ingested behind it.
    # About 90 s a trial with SmolLM2-135M on 2 cores, so 3 seeds x 2 policies fit 15 minutes.
    "laptop": WorkloadSpec(
        "laptop",
        "laptop mix: foreground chat 256/64 beside background ingestion 1,536/8",
        (
            RequestClass("chat", FOREGROUND, 256, 64, count=8, rate=0.15),
            RequestClass("ingest", BACKGROUND, 1536, 8, count=3, rate=0.05),
        ),
        SLO(5.0, 0.100, 15.0),
        warmup=1,
    ),
    # Conditions change mid-run: the laptop mix with documents of very different lengths
    # (the per-token cost moves with the position in a document) and a busy neighbour
    # process on one core during the middle third. A static cap sized for the quiet
    # phases breaks the target in the busy one, or one sized for the busy phase wastes
    # the quiet ones.
    "noisy-neighbour": WorkloadSpec(
        "noisy-neighbour",
        "laptop mix (chat 256/64) beside short 256/8 and long 1,792/8 documents; "
        "a CPU-bound neighbour process during the middle third",
        (
            RequestClass("chat", FOREGROUND, 256, 64, count=12, rate=0.15),
            RequestClass("ingest-short", BACKGROUND, 256, 8, count=4, rate=0.05),
            RequestClass("ingest-long", BACKGROUND, 1792, 8, count=3, rate=0.04),
        ),
        SLO(5.0, 0.100, 15.0),
        warmup=1,
        neighbour=True,
    ),
    # A chat that remembers: three 8-turn sessions (each turn = the previous prompt + the
    # 48-token reply + a 48-token message) beside documents arriving in the background.
    # With prefix reuse a turn prefills its new ~49 tokens; without it, the whole history.
    "multi-turn": WorkloadSpec(
        "multi-turn",
        "3 chat sessions x 8 turns (192 first, +48 message, 48 reply; 2 s think) beside ingestion 1,536/8",
        (RequestClass("ingest", BACKGROUND, 1536, 8, count=3, rate=0.03),),
        SLO(5.0, 0.100, 15.0),
        warmup=1,
        sessions=(SessionClass("chat", FOREGROUND, 192, 48, 48, turns=8, count=3, rate=0.05, think_time_s=2.0),),
    ),
    # The same sessions while a folder of six documents is dropped at the start (the laptop job's ingestion).
    "multi-turn-ingest": WorkloadSpec(
        "multi-turn-ingest",
        "3 chat sessions x 8 turns beside six 1,536-token documents submitted at once",
        (RequestClass("ingest", BACKGROUND, 1536, 8, count=6, rate=float("inf")),),
        SLO(5.0, 0.100, 15.0),
        warmup=1,
        sessions=(SessionClass("chat", FOREGROUND, 192, 48, 48, turns=8, count=3, rate=0.05, think_time_s=2.0),),
    ),
    # Two chats with goals of their own beside ingestion: one wants 20 tokens a second (T = 50 ms),
    # the other is content with about 7 (T = 150 ms); both want their reply within 5 s. Each
    # request is judged against its own goals; the controller holds the tighter target while
    # the fast chat streams and may give background more room while only the slow one does.
    "mixed-goals": WorkloadSpec(
        "mixed-goals",
        "chat at T = 50 ms and chat at T = 150 ms (256/64 each, TTFT 5 s) beside ingestion 1,536/8",
        (
            RequestClass("chat-fast", FOREGROUND, 256, 64, count=5, rate=0.08, goals=Goals(50.0, 5.0)),
            RequestClass("chat-slow", FOREGROUND, 256, 64, count=5, rate=0.08, goals=Goals(150.0, 5.0)),
            RequestClass("ingest", BACKGROUND, 1536, 8, count=3, rate=0.05),
        ),
        SLO(5.0, 0.150, 15.0),
        warmup=1,
    ),
    # Do no harm: prompts short enough that an unbounded step already meets the
    # CPU profile's 100 ms target, at a light rate. DLFP must not make it worse.
    "low-interference": WorkloadSpec(
        "low-interference",
        "light load, short prompts (8/64): little interference to remove",
        (RequestClass("chat", FOREGROUND, 8, 64, count=10, rate=0.25),),
        SLO(1.0, 0.100, 10.0),
        warmup=1,
        gate=Gate(min_reduction=None),
    ),
}


def get_spec(name: str) -> WorkloadSpec:
    if name not in SPECS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(SPECS)}")
    return SPECS[name]


def parse_slo(text: str, base: SLO) -> SLO:
    """`ttft=5,itl=35,e2el=14` (seconds, milliseconds, seconds) over `base`."""
    units = {"ttft": ("ttft_s", 1.0), "itl": ("mean_itl_s", 1e-3), "e2el": ("e2el_s", 1.0)}
    out = base
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in units:
            raise ValueError(f"--slo: unknown key {key!r}; use ttft (s), itl (ms), e2el (s)")
        try:
            number = None if value in ("none", "") else float(value)
        except ValueError:
            raise ValueError(f"--slo: {part!r} is not key=number") from None
        field, unit = units[key]
        out = replace(out, **{field: None if number is None else number * unit})
    return out
