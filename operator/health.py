"""Liveness and readiness endpoints for the operator's pod.

``/healthz`` answers 200 while the event loop runs (a hung loop cannot answer, and the
kubelet restarts the pod); ``/readyz`` answers 200 once kopf has started and filled its
indexes, 503 before.
"""

from __future__ import annotations

import threading

from aiohttp import web


class HealthServer:
    def __init__(self, ready: threading.Event, host: str = "0.0.0.0", port: int = 8080) -> None:
        self.ready = ready
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.ready.is_set():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "starting"}, status=503)

    async def start(self) -> int:
        """Start serving; returns the port (useful with port 0)."""
        app = web.Application()
        app.add_routes([web.get("/healthz", self._healthz), web.get("/readyz", self._readyz)])
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
