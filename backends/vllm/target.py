"""vLLM in-process as a benchmark target: the paper's A100 reproduction, same harness and files.

`make_target(model, profile)` gives a RunTarget (see dlfp/bench/target.py). Each
`open(policy)` starts a fresh AsyncLLM with the paper's settings (BF16, max model
len, max sequences and batch budget from the profile: 18,000 / 64 / 8,192 for
`a100-paper`; prefix caching off) and the scheduler the policy asks for:
`unbounded` is stock vLLM, `dlfp` the plug-in timed by completions, `dlfp-cadence`
the plug-in timed by the paper's scheduler-call interval, `fixed:N` a static cap.
Requests go in as token ids; each streamed token is stamped on arrival. The
plug-in's per-step records come back through a JSONL file (the scheduler runs in
vLLM's engine-core process). Before starting, the target refuses to run when
unrelated processes hold a GPU or the driver cannot run torch's CUDA, and it records
the GPU, driver, clocks and the NVML energy counters of the GPUs the run uses over
the measured window (from the first measured request to the end; warm-up excluded).

The plug-in's settings reach the engine core as DLFP_* environment variables, not
in `additional_config`: vLLM hashes `additional_config` into its compile-cache key,
so a per-run trace path there would recompile the model for every arm.

Extra engine arguments (e.g. `{"enforce_eager": true}` for a quick check) can be
given as JSON in `DLFP_VLLM_ENGINE_ARGS`.
"""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from dlfp.assembly import is_stock
from dlfp.backends.vllm.gpu import check_cuda_driver, check_exclusive, describe_gpus, energy_samples, used_gpus
from dlfp.backends.vllm.settings import CONFIG_KEY, PluginSettings
from dlfp.backends.vllm.version import SUPPORTED_VLLM
from dlfp.controller import parse_policy
from dlfp.profiles import DeviceProfile
from dlfp.sequence import Request
from dlfp.trace import RequestRecord, Trace, read_steps
from dlfp.workloads.schedule import WARMUP_TAG

ENGINE_ARGS_ENV = "DLFP_VLLM_ENGINE_ARGS"
SCHEDULER_MODULE = "dlfp.backends.vllm.scheduler"


def engine_args(model: str, profile: DeviceProfile, settings: PluginSettings, *, tensor_parallel_size: int = 1,
                async_scheduling: bool = True, extra: dict | None = None) -> dict:
    """Keyword arguments for vLLM's AsyncEngineArgs under one policy (no vLLM import)."""
    parse_policy(settings.policy, settings.params)  # a bad policy fails before any GPU work
    args = {
        "model": model,
        "dtype": "bfloat16",
        "max_model_len": profile.context_per_sequence,
        "max_num_seqs": profile.max_sequences,
        "max_num_batched_tokens": profile.max_batch_tokens,
        "enable_prefix_caching": False,
        "tensor_parallel_size": tensor_parallel_size,
        "async_scheduling": async_scheduling,
        "seed": 0,
    }
    if not is_stock(settings.policy):  # unbounded: stock vLLM, no plug-in at all
        cls = "DLFPAsyncScheduler" if async_scheduling else "DLFPScheduler"
        args["scheduler_cls"] = f"{SCHEDULER_MODULE}.{cls}"  # not in vLLM's compile hash
    return args | (extra or {})


def plugin_env(settings: PluginSettings) -> dict[str, str]:
    """The DLFP_* variables that give the plug-in `settings` (read by settings_from in the engine core)."""
    return {f"DLFP_{k.upper()}": str(v) for k, v in settings.as_config()[CONFIG_KEY].items() if v is not None}


class _Environ:
    """Set variables for the engine core's start (its process inherits them), then restore."""

    def __init__(self, values: dict[str, str]):
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def own_process_tree() -> set[int]:
    import psutil

    me = psutil.Process()
    return {me.pid, *(c.pid for c in me.children(recursive=True))}


def _load_nvml():
    try:
        import pynvml
    except ImportError:
        raise RuntimeError("the vLLM target needs NVML: pip install 'dlfp[nvidia]'") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML could not start ({exc}): the vLLM target needs an NVIDIA GPU and driver") from None
    return pynvml


class _Handle:
    def __init__(self, request_id: str, future: Future):
        self.request_id = request_id
        self._future = future

    def result(self, timeout: float | None = None) -> RequestRecord:
        return self._future.result(timeout)


class VllmTarget:
    label = "vllm"

    def __init__(self, model: str, profile: DeviceProfile, itl_target_ms: float | None = None, *,
                 tensor_parallel_size: int = 1, async_scheduling: bool = True, nvml=None):
        self.model = model
        self.profile = profile
        self.params = profile.controller_params(itl_target_ms)
        self.tensor_parallel_size = tensor_parallel_size
        self.async_scheduling = async_scheduling
        self.extra = json.loads(os.environ.get(ENGINE_ARGS_ENV) or "{}")
        self._nvml = nvml
        self._engine = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._trace: Trace | None = None
        self._pending: list[Future] = []
        self._step_file: Path | None = None
        self._gpus: list[int] = []
        self._energy_started = False
        self._vocab: int | None = None

    @property
    def nvml(self):
        if self._nvml is None:
            self._nvml = _load_nvml()
        return self._nvml

    def settings(self, policy: str) -> PluginSettings:
        return PluginSettings(policy, self.params, str(self._step_file) if self._step_file else None)

    def open(self, policy: str) -> None:
        check_exclusive(self.nvml, own_process_tree())
        import torch

        cuda_warning = check_cuda_driver(self.nvml, torch.version.cuda)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        fd, path = tempfile.mkstemp(prefix="dlfp-vllm-steps-", suffix=".jsonl")
        os.close(fd)
        self._step_file = Path(path)
        args = engine_args(self.model, self.profile, self.settings(policy), tensor_parallel_size=self.tensor_parallel_size,
                           async_scheduling=self.async_scheduling, extra=self.extra)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dlfp-vllm-loop", daemon=True)
        self._thread.start()
        settings = self.settings(policy)
        with _Environ({} if is_stock(settings.policy) else plugin_env(settings)):
            self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self._vocab = self._engine.model_config.get_vocab_size()
        self._pending = []
        self._trace = Trace(origin=time.perf_counter())
        self._trace.note(f"vllm {policy}: scheduler {args.get('scheduler_cls', 'stock')}")
        if cuda_warning:
            self._trace.note(cuda_warning)
        parallel = int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))
        self._gpus, how = used_gpus(self.nvml, own_process_tree(), parallel)
        self._energy_started = False
        self._trace.note(f"energy: NVML counters of GPU(s) {self._gpus} ({how}), measured requests only")

    def submit(self, request: Request) -> _Handle:
        assert self._engine is not None and self._loop is not None, "open() first"
        if request.priority not in ("foreground", "background"):
            raise ValueError(f"unknown priority {request.priority!r}")
        if request.tag != WARMUP_TAG and not self._energy_started:  # warm-ups run (and finish) first
            self._energy_started = True
            for sample in energy_samples(self.nvml, self._gpus, time.perf_counter()):
                self._trace.add_sample(sample)
        future = asyncio.run_coroutine_threadsafe(self._generate(request, time.perf_counter()), self._loop)
        self._pending.append(future)
        return _Handle(request.request_id, future)

    async def _generate(self, request: Request, arrival: float) -> RequestRecord:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        params = SamplingParams(max_tokens=request.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                ignore_eos=request.ignore_eos, output_kind=RequestOutputKind.DELTA)
        ids: list[int] = []
        times: list[float] = []
        finish = error = None
        try:
            async for out in self._engine.generate({"prompt_token_ids": list(request.prompt_ids)}, params,
                                                   request.request_id):
                now = time.perf_counter()
                for comp in out.outputs:
                    ids += comp.token_ids
                    times += [now] * len(comp.token_ids)
                    finish = comp.finish_reason or finish
        except Exception as exc:  # noqa: BLE001 - a failed request is data
            error = f"{type(exc).__name__}: {exc}"
        rec = RequestRecord(request.request_id, request.priority, request.tag, arrival, len(request.prompt_ids), ids,
                            times, finish, error, time.perf_counter())
        self._trace.add_request(rec)
        return rec

    def close(self) -> Trace:
        assert self._engine is not None and self._trace is not None, "open() first"
        for f in self._pending:
            f.exception()  # wait; failures are in the records
        trace = self._trace
        if self._energy_started:
            for sample in energy_samples(self.nvml, self._gpus, time.perf_counter()):
                trace.add_sample(sample)
        self._engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        for rec in read_steps(self._step_file):  # written by the plug-in in vLLM's engine core
            trace.add_step(rec)
        self._step_file.unlink(missing_ok=True)
        self._engine = self._loop = self._thread = self._trace = None
        return trace

    def describe(self) -> dict:
        desc = {
            "backend": "vllm",
            "model": self.model,
            "vllm": SUPPORTED_VLLM,
            "profile": self.profile.name,
            "controller": vars(self.params),
            "engine": engine_args(self.model, self.profile, self.settings("dlfp"),
                                  tensor_parallel_size=self.tensor_parallel_size,
                                  async_scheduling=self.async_scheduling, extra=self.extra),
            "vocab_size": self._vocab or vocab_size(self.model),
            "context_per_sequence": self.profile.context_per_sequence,
        }
        try:
            desc["gpu"] = describe_gpus(self.nvml)
        except RuntimeError as exc:
            desc["gpu"] = f"unavailable: {exc}"
        return desc


def vocab_size(model: str) -> int:
    """From the model's config.json, without starting an engine; ValueError saying why not.

    A local folder is read directly; a hub name goes through transformers, which uses
    the local cache and, unless HF_HUB_OFFLINE=1, the hub (only config.json is fetched).
    """
    folder = Path(model)
    if folder.is_dir():
        path = folder / "config.json"
        if not path.exists():
            raise ValueError(f"{model} has no config.json: pass a Hugging Face model folder")
        cfg = json.loads(path.read_text())
        found = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        if not found:
            raise ValueError(f"{path} gives no vocab_size")
        return int(found)
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model)
    except Exception as exc:  # noqa: BLE001 - the cause is the message
        offline = " (HF_HUB_OFFLINE=1 is set and it is not in the local cache)" if os.environ.get(
            "HF_HUB_OFFLINE") == "1" else ""
        raise ValueError(f"cannot read the config of {model!r}{offline}: {type(exc).__name__}: {exc}; "
                         f"pass a local model folder") from None
    found = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", None)
    if not found:
        raise ValueError(f"the config of {model!r} gives no vocab_size")
    return int(found)


def make_target(model: str | None, profile: DeviceProfile, itl_target_ms: float | None = None,
                **options) -> VllmTarget:
    if not model:
        raise ValueError("the vLLM target needs --model (a Hugging Face name or a local folder)")
    target = VllmTarget(model, profile, itl_target_ms, **options)
    # Refuse before any trial is planned; open() checks again before each engine start.
    check_exclusive(target.nvml, own_process_tree())
    target._vocab = vocab_size(model)  # a model that cannot be found fails here, with the cause
    return target
