"""Who may use the server: an API key on /v1, a Host allow-list, CORS only when asked.

The threat is the classic one for local LLM servers: any web page the user
visits can send requests to 127.0.0.1. A browser sends a cross-site `text/plain`
POST without asking (the JSON content type, required by limits.read_body, forces
a CORS preflight, which fails without --cors-origin), and DNS rebinding reaches
the port under a foreign Host name (the Host allow-list refuses it).
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from dlfp.server.errors import APIError

log = logging.getLogger("dlfp.server")
API_KEY_ENV = "DLFP_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


@dataclass(frozen=True)
class Exposure:
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # beyond the loopback names; "*" allows any Host
    cors_origins: tuple[str, ...] = ()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_allow_list(bind: str, extra: tuple[str, ...]) -> list[str]:
    """Loopback names always; the bind address when it is a specific one; then --allowed-host."""
    hosts = list(LOOPBACK_NAMES)
    if bind not in ("0.0.0.0", "::", "") and bind not in hosts:
        hosts.append(bind)
    return hosts + [h for h in extra if h not in hosts]


def install(app: FastAPI, exposure: Exposure, bind: str) -> None:
    """Middleware, outermost last: Host check, then CORS, then the API key."""
    app.add_middleware(APIKeyMiddleware, api_key=exposure.api_key)
    if exposure.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(exposure.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Priority"])
    allowed = host_allow_list(bind, exposure.allowed_hosts)
    # TrustedHostMiddleware compares the Host header without its port.
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed)


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer <key>` when a key is set (401 otherwise)."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and _header(scope, b"origin"):
            await self.app(scope, receive, send)  # a CORS preflight carries no credentials
            return
        auth = _header(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None
