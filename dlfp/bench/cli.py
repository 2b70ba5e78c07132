"""`dlfp bench` and `dlfp report`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from dlfp.bench.config import BenchArgs, load_args
from dlfp.cli import HOLD_HELP, POLICY_HELP, UserError, _policy_list, get_profile, open_backend
from dlfp.prefix_cache import DEFAULT_HOLD_S
from dlfp.workloads.specs import SPECS


def _split(spec: str | None) -> list[str] | None:
    return None if spec is None else [p.strip() for p in spec.split(",") if p.strip()]


@click.command()
@click.option("--workload", default="laptop", show_default=True,
              help=", ".join(SPECS))
@click.option("--policies", default="unbounded,dlfp", show_default=True, help=POLICY_HELP + " (first: baseline)")
@click.option("--seeds", type=int, multiple=True, help="Seeds, repeatable or space-separated  [default: 801 802 803]")
@click.option("--rate", type=float, default=None, help="Foreground requests/s (default: the workload's).")
@click.option("--requests", type=int, default=None, help="Measured foreground requests (default: the workload's).")
@click.option("--warmup", type=int, default=None, help="Warmup requests before each trial (default: the workload's).")
@click.option("--scale", type=float, default=1.0, show_default=True, help="Multiply every token count (keeps ratios).")
@click.option("--burstiness", type=float, default=1.0, show_default=True, help="Gamma shape of arrival gaps (1: Poisson).")
@click.option("--slo", default=None, help="Override the SLO: ttft=S,itl=MS,e2el=S.")
@click.option("--out", type=click.Path(), default="runs/bench", show_default=True)
@click.option("--backend", default="llamacpp", show_default=True,
              help="llamacpp, executorch, mlc, sim (SIMULATED), vllm, mlc-engine (dlfp.targets)")
@click.option("--model", default=None, help="Model file (default: the embedded SmolLM2-135M) or endpoint model name.")
@click.option("--profile", default=None, help="Device profile name or TOML path [default: a100-paper for vllm, else cpu-laptop].")
@click.option("--threads", type=int, default=None, help="CPU threads (default: physical cores).")
@click.option("--kv-unified", is_flag=True, help="llama.cpp: one KV cache shared by all sequences.")
@click.option("--itl-target-ms", type=float, default=None, help="DLFP target (default: the profile's).")
@click.option("--sweep", default=None, help="Fixed caps to sweep, e.g. fixed:8,16,32 (runs unbounded, them, dlfp).")
@click.option("--overhead", is_flag=True, help="Measure runtime overhead against llama-cpp-python's own loop.")
@click.option("--from", "from_config", type=click.Path(exists=True), default=None, help="Rerun DIR/config.json.")
@click.option("--gate-p99-itl-reduction", type=float, default=None, help="Gate: P99 ITL reduction in every trial.")
@click.option("--endpoint", "endpoints", multiple=True, help="LABEL=URL of an OpenAI-compatible server (repeatable).")
@click.option("--prompts", type=click.Choice(["text", "random"]), default="text", show_default=True,
              help="Exact-token prompts cut from bundled text (needs the target's tokenizer) or random ids.")
@click.option("--vocab-size", type=int, default=None, help="Endpoints only: the served model's vocabulary size.")
@click.option("--tokenizer", default=None, help="Endpoints only: the served model's GGUF, to cut text prompts.")
@click.option("--no-cache-prompt", is_flag=True, help="Every request asks for a cold prefill (cache_prompt=false).")
@click.option("--prefix-hold-s", type=click.FloatRange(0), default=DEFAULT_HOLD_S, show_default=True,
              help=HOLD_HELP)
@click.option("--probe-period-s", type=float, default=0.5, show_default=True, help="Probe sampling period (0: off).")
@click.argument("extra_seeds", nargs=-1, type=int)
@click.pass_context
def bench(ctx, workload, policies, seeds, rate, requests, warmup, scale, burstiness, slo, out, backend, model,
          profile, threads, kv_unified, itl_target_ms, sweep, overhead, from_config, gate_p99_itl_reduction,
          endpoints, prompts, vocab_size, tokenizer, no_cache_prompt, prefix_hold_s, probe_period_s, extra_seeds):
    """Paired trials of prefill policies on an exact-token workload."""
    if from_config:
        try:
            args = load_args(from_config)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if ctx.get_parameter_source("out") == ParameterSource.COMMANDLINE:
            args.out = out
    else:
        args = BenchArgs(
            workload=workload, policies=_split(policies) or [], seeds=[*seeds, *extra_seeds] or [801, 802, 803],
            rate=rate, requests=requests, warmup=warmup, scale=scale, burstiness=burstiness, slo=slo, out=out,
            backend=backend, model=model, profile=profile or _default_profile(backend), threads=threads, kv_unified=kv_unified,
            itl_target_ms=itl_target_ms, sweep=_expand_sweep(sweep), overhead=overhead,
            gate_p99_itl_reduction=gate_p99_itl_reduction, endpoints=list(endpoints), vocab_size=vocab_size,
            prompts=prompts, tokenizer=tokenizer, cache_prompt=not no_cache_prompt,
            probe_period_s=probe_period_s or None, prefix_hold_s=prefix_hold_s,
        )
    prof = get_profile(args.profile)
    if args.overhead:
        _run_overhead(args, prof)
        return
    if not args.endpoints:
        _policy_list(",".join(args.policies + (args.sweep or [])), prof, args.backend)
    _run_bench(args, prof)


def _default_profile(backend: str) -> str:
    from dlfp.targets import get_target

    try:
        return get_target(backend).default_profile  # vLLM: the paper's operating point
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _expand_sweep(spec: str | None) -> list[str] | None:
    """`fixed:8,16,32` -> [fixed:8, fixed:16, fixed:32]; `fixed:8,fixed:16` works too."""
    if spec is None:
        return None
    out = []
    for part in _split(spec) or []:
        out.append(part if ":" in part or not part.isdigit() else f"fixed:{part}")
    if not out:
        raise UserError("--sweep is empty")
    return out


def _run_bench(args: BenchArgs, prof) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dlfp.bench import harness
    from dlfp.bench.table import print_result

    try:
        bench = harness.prepare(args, open_backend, prof)
    except harness.BenchError as exc:
        raise UserError(str(exc)) from None
    console = Console()
    console.print(f"workload {bench.spec.name} ({bench.spec.description}, scale {bench.spec.scale:g}); "
                  f"arms {', '.join(bench.arm_names)}; seeds {' '.join(map(str, args.seeds))}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("starting", total=bench.total_requests)
            result = harness.run(
                bench,
                on_request=lambda: progress.advance(task),
                on_trial=lambda label: progress.update(task, description=label),
            )
    finally:
        harness.close(bench)
    print_result(bench.rows, result, console)
    console.print(f"wrote {bench.out}/trials.jsonl, paired.json, config.json and per-trial traces; "
                  f"plots: dlfp report {bench.out}")
    candidates = result["paired"]["candidates"].values()
    if any(not c["exact_output_agreement"] or not c["reconciled"] for c in candidates):
        sys.exit(1)


def _run_overhead(args: BenchArgs, prof) -> None:
    from rich.console import Console

    from dlfp.bench.config import build_config
    from dlfp.policy import params_to_dict
    from dlfp.bench.overhead import OverheadError, measure_overhead, print_overhead

    if args.backend != "llamacpp":
        raise UserError("--overhead compares against llama-cpp-python: use --backend llamacpp")
    backend = open_backend("llamacpp", args.model, prof, args.threads, args.kv_unified)
    try:
        result = measure_overhead(backend, prof, args.itl_target_ms)
    except OverheadError as exc:
        raise UserError(str(exc)) from None
    finally:
        desc = backend.describe()
        backend.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    from dlfp.workloads.specs import get_spec

    cfg = build_config(args, get_spec(args.workload), prof, {"llamacpp": desc}, params_to_dict(prof.controller_params(args.itl_target_ms)))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
    print_overhead(result, Console())
    click.echo(f"wrote {out / 'overhead.json'}")


def _docs_option(ctx, param, value) -> None:
    """--docs / --check-docs: the docs' tables against their runs/ folders, then exit (no DIRECTORY)."""
    if not value:
        return
    from dlfp.bench.doc_tables import rewrite_docs

    root = Path.cwd()
    if not (root / "README.md").is_file():
        raise UserError(f"{param.opts[0]}: run it from the repository root ({root} has no README.md)")
    check = param.name == "check_docs"
    try:
        stale = rewrite_docs(root, check=check)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{param.opts[0]}: {exc}") from None
    for path in stale:
        click.echo(f"{'differs from its runs' if check else 'redrawn'}: {path.relative_to(root)}")
    if not stale:
        click.echo("every table matches its runs/ folder")
    ctx.exit(1 if check and stale else 0)


@click.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--no-table", is_flag=True, help="Only write the plots.")
# Eager, so that they run before DIRECTORY is asked for: they act on the docs, not on one run.
@click.option("--docs", is_flag=True, is_eager=True, expose_value=False, callback=_docs_option,
              help="Redraw every table of README.md and docs/*.md from the runs/ folder its marker names.")
@click.option("--check-docs", is_flag=True, is_eager=True, expose_value=False, callback=_docs_option,
              help="Only list the docs whose tables differ from their runs/ folders; exit 1 if any.")
@click.option("--trace", "trace_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Draw this step trace (steps-*.jsonl) as a decision timeline into DIRECTORY.")
@click.option("--target-ms", type=float, default=None, help="With --trace: the ITL target line.")
def report(directory, no_table, trace_file, target_ms):
    """Plots (PNG) and tables from a `dlfp bench` output folder."""
    from dlfp.bench.plots import PlotError, write_plots
    from dlfp.bench.table import print_result

    folder = Path(directory)
    if trace_file is not None:
        from dlfp.bench.plots import decision_timeline
        from dlfp.trace import read_steps

        path = Path(trace_file)
        steps = read_steps(path)
        if not steps:
            raise UserError(f"{path} holds no steps")
        stem = path.name.removesuffix(".gz").removesuffix(".jsonl")
        click.echo(f"wrote {decision_timeline(steps, folder / (stem + '-decisions.png'), target_ms, stem)}")
        return
    if (folder / "overhead.json").exists() and not (folder / "trials.jsonl").exists():
        from rich.console import Console

        from dlfp.bench.overhead import print_overhead

        print_overhead(json.loads((folder / "overhead.json").read_text()), Console())
        return
    try:
        written = write_plots(folder)
    except PlotError as exc:
        raise UserError(str(exc)) from None
    if not no_table and (folder / "paired.json").exists():
        rows = [json.loads(line) for line in (folder / "trials.jsonl").read_text().splitlines() if line.strip()]
        print_result(rows, json.loads((folder / "paired.json").read_text()))
    for p in written:
        click.echo(f"wrote {p}")


__all__ = ["bench", "report"]
