"""The health endpoints (:mod:`shardwise.operator.health`)."""

from __future__ import annotations

import asyncio
import socket
import threading
import urllib.error
import urllib.request

from shardwise.operator.health import HealthServer


def test_health_endpoints() -> None:
    ready = threading.Event()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def probe() -> list[int]:
        server = HealthServer(ready, "127.0.0.1", port)
        await server.start()
        codes = []
        for path, flip in (("/healthz", False), ("/readyz", False), ("/readyz", True)):
            if flip:
                ready.set()
            try:
                with await asyncio.to_thread(
                    urllib.request.urlopen, f"http://127.0.0.1:{port}{path}"
                ) as r:
                    codes.append(r.status)
            except urllib.error.HTTPError as err:
                codes.append(err.code)
        await server.stop()
        return codes

    assert asyncio.run(probe()) == [200, 503, 200]
