"""`dlfp serve`: an OpenAI-compatible HTTP server over the dlfp engine.

The engine keeps its own thread; the ASGI event loop only submits requests and
relays token events (woken with `call_soon_threadsafe`), so no request ever waits
on a step in the loop. A request's class (foreground/background) comes from its
`priority` field or the `X-Priority` header.
"""
