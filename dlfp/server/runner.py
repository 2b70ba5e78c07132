"""uvicorn around the app, with a shutdown that says what happened to each request."""
from __future__ import annotations

import logging
import signal
import threading

import click
import uvicorn

from dlfp.server.app import ServerState, create_app

log = logging.getLogger("dlfp.server")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: refuse new requests, give in-flight ones `grace` seconds, then abort them.

    uvicorn waits for open connections; an aborted request ends its stream with an
    error event, so the wait ends with it. The lifespan's shutdown logs which
    requests finished and which were aborted.
    """

    def __init__(self, state: ServerState, host: str, port: int, grace: float):
        config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=grace + 5.0)  # a backstop behind our own abort
        super().__init__(config)
        self.state, self.grace = state, grace

    def handle_exit(self, sig: int, frame) -> None:
        bridge = self.state.bridge
        if not bridge.draining:
            running = bridge.begin_drain()
            click.echo(f"dlfp serve: {signal.Signals(sig).name}: {len(running)} request(s) in flight, "
                       f"up to {self.grace:g} s to finish", err=True)
            timer = threading.Timer(self.grace, self._abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)

    def _abort_all(self) -> None:
        aborted = self.state.bridge.abort_all()
        if aborted:
            log.warning("grace period over: aborting %s", ", ".join(aborted))
