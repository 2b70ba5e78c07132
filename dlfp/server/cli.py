"""`dlfp serve`. Imports nothing of the server stack until it runs, so `dlfp --help`
works without the `server` extra."""
from __future__ import annotations

from pathlib import Path

import click

from dlfp.cli import HOLD_HELP, POLICY_HELP, UserError, get_profile, model_options, open_backend
from dlfp.prefix_cache import DEFAULT_HOLD_S


@click.command()
@model_options
@click.option("--policy", default="dlfp", show_default=True, help=f"One of: {POLICY_HELP}.")
@click.option("--itl-target-ms", type=float, default=None, help="Foreground ITL goal (default: the profile's).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--max-queue", type=click.IntRange(0), default=64, show_default=True,
              help="Requests that may wait for a sequence slot; more get HTTP 429.")
@click.option("--served-model-name", default=None, help="Model id in the API (default: the file name).")
@click.option("--shutdown-grace", type=click.FloatRange(0), default=10.0, show_default=True,
              help="Seconds in-flight requests get to finish after SIGTERM before they are aborted.")
@click.option("--kv-unified", is_flag=True, help="llama.cpp: one KV cache shared by all sequences.")
@click.option("--prefix-hold-s", type=click.FloatRange(0), default=DEFAULT_HOLD_S, show_default=True, help=HOLD_HELP)
@click.option("--max-body-mb", type=click.FloatRange(0, min_open=True), default=8.0, show_default=True,
              help="Largest request body in MiB; larger ones get HTTP 413 before they are read or tokenised.")
@click.option("--max-tokens-limit", type=click.IntRange(1), default=None,
              help="Most tokens one request may generate (a larger max_tokens gets HTTP 400). Also the default "
                   "when a request omits max_tokens; without this option that default is the whole remaining "
                   "context.")
@click.option("--api-key", envvar="DLFP_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every /v1 route (HTTP 401 otherwise).")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="A Host name clients may use besides the loopback names (repeatable; '*' allows any). "
                   "Needed for a non-loopback bind: a foreign Host header gets HTTP 400.")
@click.option("--cors-origin", "cors_origins", multiple=True,
              help="A web origin allowed to call the API from a browser (repeatable). Default: none (CORS off).")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of the Batch API's database, kept across restarts (default: $DLFP_STATE_DIR, else the "
                   "user's data folder for dlfp). One server per folder.")
@click.option("--batch-max-file-mb", type=click.FloatRange(0, min_open=True), default=100.0, show_default=True,
              help="Largest batch input file in MiB (HTTP 413 past it).")
@click.option("--batch-max-lines", type=click.IntRange(1), default=50_000, show_default=True,
              help="Most requests in one batch input file (HTTP 400 past it).")
@click.option("--batch-max-queued", type=click.IntRange(1), default=16, show_default=True,
              help="Most unfinished batches at once (HTTP 429 past it).")
def serve(model, backend, profile, threads, policy, itl_target_ms, host, port, max_queue, served_model_name,
          shutdown_grace, kv_unified, prefix_hold_s, max_body_mb, max_tokens_limit, api_key, allowed_hosts, cors_origins,
          state_dir, batch_max_file_mb, batch_max_lines, batch_max_queued):
    """An OpenAI-compatible server whose requests are foreground or background, with a Batch API
    whose requests run in the background and survive restarts."""
    try:
        from dlfp.server.app import ServeOptions, ServerState
        from dlfp.server.batch_input import BatchLimits
        from dlfp.server.batch_service import BatchOptions
        from dlfp.server.exposure import Exposure, is_loopback
        from dlfp.server.runner import DrainingServer
        from dlfp.server.state_dir import default_state_dir
    except ImportError as exc:
        raise UserError(f"{exc}: install the server extra (pip install 'dlfp[server]')") from None
    from dlfp.assembly import build_engine
    from dlfp.cli import _policy_list

    prof = get_profile(profile)
    _policy_list(policy, prof, backend)
    if not is_loopback(host) and not allowed_hosts:
        click.echo(f"dlfp serve: --host {host} is not loopback: only requests whose Host header names "
                   f"a loopback address{'' if host in ('0.0.0.0', '::') else ' or ' + host} are served; "
                   f"add --allowed-host NAME for the names clients use", err=True)
    if not is_loopback(host) and not api_key:
        click.echo(f"dlfp serve: warning: --host {host} without --api-key: anyone who can reach the port "
                   f"can use the model", err=True)
    limits = BatchLimits(int(batch_max_file_mb * 2**20), batch_max_lines, batch_max_queued)
    batch = BatchOptions(Path(state_dir) if state_dir else default_state_dir(), limits)
    options = ServeOptions(max_queue=max_queue, max_body_bytes=int(max_body_mb * 2**20),
                           max_tokens_limit=max_tokens_limit, host=host,
                           exposure=Exposure(api_key or None, tuple(allowed_hosts), tuple(cors_origins)), batch=batch)
    be = open_backend(backend, model, prof, threads, kv_unified)
    name = served_model_name or Path(str(be.describe().get("model_path", backend))).stem
    # The server starts the engine (ASGI lifespan); probes and the governor run with it.
    engine = build_engine(be, policy, prof, itl_target_ms=itl_target_ms, start=False, prefix_hold_s=prefix_hold_s)
    state = ServerState(engine, name, policy, options)
    server = DrainingServer(state, host, port, shutdown_grace)
    click.echo(f"dlfp serve: http://{host}:{port}/v1  model {name}  policy {policy}  profile {prof.name}", err=True)
    if state.batch is not None:
        click.echo(f"dlfp serve: batch state in {state.batch.path}", err=True)
    else:
        click.echo(f"dlfp serve: warning: the Batch API is off: {state.batch_off}", err=True)
    try:
        server.run()
    finally:
        be.close()
