"""The `dlfp` command."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from dlfp.profiles import load_profile
from dlfp.prefix_cache import DEFAULT_HOLD_S

POLICY_HELP = ("comma-separated: unbounded, dlfp, dlfp-paper, dlfp-cadence, fixed:N; "
               "dlfp:name=value[:name=value] overrides a controller parameter or the preemption budget for that arm "
               "(dlfp:quantile=0.995, dlfp:preemption_budget_ms=150)")
HOLD_HELP = ("Seconds after its last turn that a conversation's cached prefix is kept from background requests "
             "(they wait for another slot; 0: no hold, inf: for ever).")


class UserError(click.ClickException):
    """One clear line for the user, no traceback."""


def open_backend(name: str, model: str | None, profile, threads: int | None, kv_unified: bool = False):
    """Load an owned-loop backend by name, turning every load failure into one line."""
    from dlfp.targets import load_backend

    try:
        return load_backend(name, model, profile, n_threads=threads, kv_unified=kv_unified)
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise UserError(str(exc)) from None


def get_profile(name: str):
    try:
        return load_profile(name)
    except ValueError as exc:
        raise UserError(str(exc)) from None


# Commands that live in their own modules, imported only when invoked.
LAZY_COMMANDS = {
    "bench": "dlfp.bench.cli:bench",
    "report": "dlfp.bench.cli:report",
    "probe": "dlfp.devices.cli:probe",
    "check-backend": "dlfp.backends.conformance:check_backend_command",
    "export-executorch": "dlfp.backends.executorch_export:export_command",
    "check-model": "dlfp.backends.check_model:check_model_command",
    "serve": "dlfp.server.cli:serve",
    "batch": "dlfp.batch_cli:batch",
    "study": "dlfp.study:study",
    "soak": "dlfp.server.soak:soak",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self._available()))

    def get_command(self, ctx, name):
        if name in self.commands:
            return self.commands[name]
        target = self._available().get(name)
        if target is None:
            return None
        import importlib

        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    @staticmethod
    def _available() -> dict[str, str]:
        import importlib.util

        out = {}
        for name, target in LAZY_COMMANDS.items():
            module = target.split(":")[0]
            try:
                if importlib.util.find_spec(module) is not None:
                    out[name] = target
            except ModuleNotFoundError:
                pass
        return out


@click.group(cls=LazyGroup)
@click.option("-v", "--verbose", is_flag=True, help="Log engine decisions.")
def main(verbose: bool) -> None:
    """dlfp: keep a foreground chat smooth while background LLM work shares the device."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


def model_options(f):
    f = click.option("--model", type=str, default=None, help="GGUF file (default: the embedded SmolLM2-135M).")(f)
    f = click.option("--backend", default="llamacpp", show_default=True,
                     help="Runtime adapter: llamacpp, executorch, mlc, sim (SIMULATED), ...")(f)
    f = click.option("--profile", default="cpu-laptop", show_default=True, help="Device profile name or TOML path.")(f)
    f = click.option("--threads", type=int, default=None, help="CPU threads (default: physical cores).")(f)
    return f


@main.command()
@model_options
@click.option("--policies", default="unbounded,dlfp", show_default=True, help=POLICY_HELP)
@click.option("--itl-target-ms", type=float, default=None, help="Foreground ITL goal (default: the profile's).")
@click.option("--docs", type=click.Path(), default=None, help="Folder of .txt/.md documents to ingest.")
@click.option("--chat-script", type=click.Path(), default=None, help="JSON chat script (default: bundled).")
@click.option("--turns", type=int, default=None, help="Use only the first N chat turns.")
@click.option("--max-docs", type=int, default=None, help="Ingest only the first N documents.")
@click.option("--kv-unified", is_flag=True, help="llama.cpp: one KV cache shared by all sequences.")
@click.option("--no-cache-prompt", is_flag=True, help="Prefill every prompt whole (no reuse of a turn's cached prefix).")
@click.option("--prefix-hold-s", type=click.FloatRange(0), default=DEFAULT_HOLD_S, show_default=True, help=HOLD_HELP)
@click.option("--out", type=click.Path(), default="runs/laptop", show_default=True)
def laptop(model, backend, profile, threads, policies, itl_target_ms, docs, chat_script, turns, max_docs,
           kv_unified, no_cache_prompt, prefix_hold_s, out):
    """Foreground chat + background document ingestion, under each policy."""
    from dataclasses import replace

    from dlfp.laptop import LaptopSettings, run_laptop
    from dlfp.report_table import laptop_table
    from dlfp.workloads.laptop import load_chat_script, load_documents

    prof = get_profile(profile)
    try:
        script = load_chat_script(chat_script)
        documents = load_documents(docs)
    except (ValueError, OSError, KeyError) as exc:
        raise UserError(f"bad workload input: {exc}") from None
    if turns is not None:
        script = replace(script, turns=script.turns[:turns])
    if max_docs is not None:
        documents = documents[:max_docs]
    policy_list = _policy_list(policies, prof, backend)
    be = open_backend(backend, model, prof, threads, kv_unified)
    settings = LaptopSettings(
        policies=policy_list,
        itl_target_ms=itl_target_ms if itl_target_ms is not None else prof.itl_target_ms,
        profile=prof,
        script=script,
        docs=documents,
        out=Path(out),
        cache_prompt=not no_cache_prompt,
        prefix_hold_s=prefix_hold_s,
    )
    from rich.progress import Progress

    per_session = len(script.turns) + len(documents)
    total = len(script.turns) + per_session * len(policy_list)
    with Progress(transient=True) as progress:
        task = progress.add_task("starting", total=total)
        summary = run_laptop(
            be,
            settings,
            on_progress=lambda: progress.advance(task),
            on_session=lambda label: progress.update(task, description=f"running {label}"),
        )
    laptop_table(summary)
    click.echo(f"summary: {Path(out) / 'summary.json'}")
    if summary["policies"] and any(p["requests_failed"] for p in summary["policies"].values()):
        sys.exit(1)


@main.command()
@model_options
@click.argument("prompt")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
def generate(model, backend, profile, threads, prompt, max_tokens, temperature, top_p):
    """Chat once with the model and stream the reply (a quick sanity check)."""
    from dlfp.assembly import build_engine
    from dlfp.engine import InvalidRequest
    from dlfp.sequence import Request, SamplingParams

    prof = get_profile(profile)
    be = open_backend(backend, model, prof, threads)
    try:
        sampling = SamplingParams(temperature, top_p)
        ids = be.apply_chat_template([{"role": "user", "content": prompt}])
        # One request alone: nothing to protect, so the stock runtime's full batches.
        engine = build_engine(be, "unbounded", prof, probe_period_s=None)
        handle = engine.submit(Request(ids, max_tokens, sampling=sampling))
    except (ValueError, InvalidRequest) as exc:
        raise UserError(str(exc)) from None
    out: list[int] = []
    shown = ""
    for token in handle:
        out.append(token)
        text = be.detokenize(out)
        click.echo(text[len(shown):], nl=False)
        shown = text
    click.echo()
    engine.shutdown()


def _policy_list(spec: str, prof, backend: str = "llamacpp") -> list[str]:
    """Policy names, each checked now: that it parses and that the backend can run it."""
    from dlfp.assembly import make_policy
    from dlfp.targets import get_target

    names = [p.strip() for p in spec.split(",") if p.strip()]
    if not names:
        raise UserError("--policies is empty")
    try:
        entry = get_target(backend)
        for name in names:
            make_policy(name, prof)
            entry.check_policy(name)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return names


if __name__ == "__main__":
    main()
