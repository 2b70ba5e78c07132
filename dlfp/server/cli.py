"""`dlfp serve`. Imports nothing of the server stack until it runs, so `dlfp --help`
works without the `server` extra."""
from __future__ import annotations

from pathlib import Path

import click

from dlfp.cli import POLICY_HELP, UserError, get_profile, model_options, open_backend


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
def serve(model, backend, profile, threads, policy, itl_target_ms, host, port, max_queue, served_model_name,
          shutdown_grace, kv_unified):
    """An OpenAI-compatible server whose requests are foreground or background."""
    try:
        from dlfp.server.app import ServerState
        from dlfp.server.runner import DrainingServer
    except ImportError as exc:
        raise UserError(f"{exc}: install the server extra (pip install 'dlfp[server]')") from None
    from dlfp.assembly import build_engine
    from dlfp.cli import _policy_list

    prof = get_profile(profile)
    _policy_list(policy, prof, backend)
    be = open_backend(backend, model, prof, threads, kv_unified)
    name = served_model_name or Path(str(be.describe().get("model_path", backend))).stem
    # The server starts the engine (ASGI lifespan); probes and the governor run with it.
    engine = build_engine(be, policy, prof, itl_target_ms=itl_target_ms, start=False)
    server = DrainingServer(ServerState(engine, name, policy, max_queue), host, port, shutdown_grace)
    click.echo(f"dlfp serve: http://{host}:{port}/v1  model {name}  policy {policy}  profile {prof.name}", err=True)
    try:
        server.run()
    finally:
        be.close()
