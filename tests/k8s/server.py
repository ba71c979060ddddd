"""Run the emulator on its own event loop in a background thread, for synchronous tests.

Tests (and the embedded kopf operator, on a loop of its own) talk to it over HTTP on
127.0.0.1, exactly as they would to a cluster.
"""

from __future__ import annotations

import asyncio
import threading

import kmock

from k8s.emulator import ApiEmulator


class EmulatorServer:
    """Start with :meth:`start`, stop with :meth:`stop`; ``url`` is the API's base URL."""

    def __init__(self, emulator: ApiEmulator | None = None) -> None:
        self.emulator = emulator if emulator is not None else ApiEmulator()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)
        self._error: BaseException | None = None
        self.url = ""

    def start(self, timeout: float = 10.0) -> EmulatorServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the API emulator did not start")
        if self._error is not None:
            raise RuntimeError("the API emulator failed to start") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving; stopping a stopped server does nothing."""
        if not self._thread.is_alive():
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # surfaced by start()
            self._error = err
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self.emulator, kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()
