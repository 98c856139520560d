"""``Server-Timing: app;dur=<ms>`` on every answer: how long the app took from receiving the
request to starting the answer, so a client (or a benchmark) can tell the server's time from
the proxy's and the network's (a standard header; browsers' developer tools show it)."""

from __future__ import annotations

import time


class ServerTiming:
    def __init__(self, app):
        self.app = app

    def __getattr__(self, name):  # the wrapped app's attributes (e.g. ``api``) stay reachable
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()

        async def timed(message):
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - t0) * 1000.0
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"server-timing", f"app;dur={ms:.3f}".encode())],
                }
            await send(message)

        await self.app(scope, receive, timed)
