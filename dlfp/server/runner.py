"""uvicorn around the app, with a shutdown that says what happened to each request."""
from __future__ import annotations

import logging
import signal
import threading
import time

import click
import uvicorn

from dlfp.server.app import ServerState, create_app

log = logging.getLogger("dlfp.server")


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: refuse new requests, give in-flight ones `grace` seconds, then abort them.

    The listening socket stays open while draining, so a new client gets the
    documented 503 (and /health says "draining") instead of a refused connection;
    uvicorn is told to exit only once nothing is in flight. An aborted request ends
    its stream with an error event. The lifespan's shutdown logs which requests
    finished and which were aborted. A drain exits with status 0; a second signal
    stops at once (uvicorn's own handling, which re-raises the signal).
    """

    POLL_S = 0.05

    def __init__(self, state: ServerState, host: str, port: int, grace: float):
        config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=grace + 5.0)  # a backstop behind our own abort
        super().__init__(config)
        self.state, self.grace = state, grace

    def handle_exit(self, sig: int, frame) -> None:
        bridge = self.state.bridge
        if bridge.draining:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        running = bridge.begin_drain()
        click.echo(f"dlfp serve: {signal.Signals(sig).name}: {len(running)} request(s) in flight, "
                   f"up to {self.grace:g} s to finish", err=True)
        threading.Thread(target=self._drain, name="dlfp-drain", daemon=True).start()

    def _drain(self) -> None:
        bridge = self.state.bridge
        deadline = time.monotonic() + self.grace
        while bridge.in_flight and time.monotonic() < deadline:
            time.sleep(self.POLL_S)
        if bridge.in_flight:
            aborted = bridge.abort_all()
            log.warning("grace period over: aborting %s", ", ".join(aborted))
            end = time.monotonic() + 5.0  # the aborts land at the engine's next step
            while bridge.in_flight and time.monotonic() < end:
                time.sleep(self.POLL_S)
        self.should_exit = True  # uvicorn's main loop polls this: close the listener, finish responses
