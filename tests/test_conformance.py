"""The backend conformance suite, run for real against every adapter that can run here.

Other adapters join by adding a factory to FACTORIES. The last tests break a real
adapter on purpose and check the suite notices (a suite that cannot fail proves nothing).
"""
import dataclasses

import pytest

from dlfp.backends import conformance
from dlfp.backends.conformance import CHECKS, FAIL, PASS, SKIP, run_check
from dlfp.protocol import Backend, Limits, StepResult


def _llamacpp(tmp):
    pytest.importorskip("llama_cpp")
    from tiny_gguf import CHATML, write_tiny_gguf

    from dlfp.protocol import Limits
    from dlfp.backends.llamacpp import LlamaCppBackend, LlamaCppConfig

    path = write_tiny_gguf(tmp / "conf.gguf", vocab=512, chat_template=CHATML)
    return LlamaCppBackend(LlamaCppConfig(str(path), limits=Limits(4, 512, 128), n_threads=1))


def _executorch(tmp, multi_sequence=True, packed=False):
    pytest.importorskip("executorch")
    from tiny_pte import tiny_packed_pte, tiny_pte

    from dlfp.backends.executorch import ExecuTorchBackend, ExecuTorchConfig

    pte = tiny_packed_pte(tmp) if packed else tiny_pte(tmp)
    cfg = ExecuTorchConfig(str(pte), Limits(4, 2048, 128), n_threads=1, multi_sequence=multi_sequence)
    return ExecuTorchBackend(cfg)


def _torch(tmp):
    pytest.importorskip("torch")
    from dlfp.backends.torch.backend import TorchBackend
    from dlfp.backends.torch.config import ModelConfig

    return TorchBackend(ModelConfig.load("tiny"), None, n_seq=4, n_ctx=2048, n_batch=128, device="cpu",
                        dtype="float32", n_threads=1)


FACTORIES = {
    "llamacpp": _llamacpp,
    "torch": _torch,
    "executorch": _executorch,
    # The same program declared single-sequence: the scheduler must time-slice it.
    "executorch-single": lambda tmp: _executorch(tmp, multi_sequence=False),
    # One Program, one execute per step, every sequence packed into it.
    "executorch-packed": lambda tmp: _executorch(tmp, packed=True),
}


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def backend(request, tmp_path_factory):
    b = FACTORIES[request.param](tmp_path_factory.getbasetemp())
    yield b
    b.close()


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
def test_conformance(backend, check):
    result = run_check(check, backend)
    assert result.status != FAIL, result.detail
    if check.needs:
        assert result.status == (PASS if check.applies_to(backend.capabilities) else SKIP), result.detail
    elif check.name == "prefix_reuse":
        assert result.status == PASS, result.detail
        assert ("not declared" in result.detail) != backend.capabilities.prefix_reuse
    else:
        assert result.status == PASS, result.detail


# -- the suite catches broken adapters -------------------------------------------
class Broken(Backend):
    """Delegates to a real backend, then breaks one promise."""

    def __init__(self, inner: Backend, **breaks):
        self.inner, self.breaks = inner, breaks
        self.name = "broken"
        caps = inner.capabilities
        self.capabilities = dataclasses.replace(caps, multi_sequence=False) if breaks.get("lie_single") else caps

    def step(self, plan):
        r = self.inner.step(plan)
        if self.breaks.get("launch_time"):
            return StepResult(r.logits, 1e-6)  # what a timer around an async launch sees
        if self.breaks.get("chunk_noise") and any(not c.wants_logits for c in plan.prefills):
            self._stale = True
        if self.breaks.get("chunk_noise") and getattr(self, "_stale", False):
            r.logits = {k: v + 5.0 * (v > v.mean()) for k, v in r.logits.items()}
        return r

    def free_sequence(self, seq_id):
        self._stale = False
        self.inner.free_sequence(seq_id)

    def keep_prefix(self, seq_id, n_tokens):
        if self.breaks.get("forget_prefix"):
            self.inner.free_sequence(seq_id)  # claims to keep the prefix, drops it all
            return True
        return self.inner.keep_prefix(seq_id, n_tokens)

    def tokenize(self, text, add_special=True):
        return self.inner.tokenize(text, add_special)

    def detokenize(self, ids):
        return self.inner.detokenize(ids)

    def is_eos(self, token_id):
        return self.inner.is_eos(token_id)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    b = _llamacpp(tmp_path_factory.mktemp("broken"))
    yield b
    b.close()


@pytest.mark.parametrize(
    "breaks, check",
    [
        ({"launch_time": True}, "completion_timing"),
        ({"lie_single": True}, "capabilities"),
        ({"chunk_noise": True}, "chunked_prefill"),
        ({"forget_prefix": True}, "prefix_reuse"),
    ],
)
def test_suite_catches_broken_adapter(llama, breaks, check):
    chosen = next(c for c in CHECKS if c.name == check)
    result = run_check(chosen, Broken(llama, **breaks))
    assert result.status == FAIL, result.detail


def test_run_all_reports_every_check(llama):
    class Unclosed(Broken):
        def close(self):
            pass  # the module fixture owns the real backend

    results = conformance.run_all(lambda: Unclosed(llama), checks=CHECKS[:1])
    assert [r.name for r in results] == [CHECKS[0].name] and results[0].ok


def test_check_backend_cli_errors():
    from click.testing import CliRunner

    from dlfp.cli import main

    r = CliRunner().invoke(main, ["check-backend", "no-such-backend"])
    assert r.exit_code != 0 and "unknown backend" in r.output
    r = CliRunner().invoke(main, ["check-backend", "executorch"])
    assert r.exit_code != 0 and "--model" in r.output
