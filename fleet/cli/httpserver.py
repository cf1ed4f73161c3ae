"""uvicorn as the ``fleet`` processes run it (the gateway, the dispatcher's status server): on a socket bound
beforehand, with the process's own signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn

log = logging.getLogger(__name__)


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the runner owns SIGINT/SIGTERM and the shutdown order.

    Given ``sock`` (bound beforehand by ``fleet.cli.ports.listen_socket``, so a busy port fails before anything
    starts), it serves on that socket. ``up`` is set once the server accepts connections; a start-up that uvicorn
    gives up on (a failed lifespan start-up, which it logs) ends ``serve`` with ``started`` false instead of
    ``SystemExit``.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        sock: socket.socket | None = None,
        startup_errors: list[BaseException] | None = None,
    ) -> None:
        """``startup_errors``: where the app records what stopped its start-up (``create_app``'s
        ``on_startup_error``), for the runner to say."""
        super().__init__(config)
        self.sock = sock
        self.up = asyncio.Event()
        self.startup_errors = startup_errors if startup_errors is not None else []

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets if sockets is not None or self.sock is None else [self.sock])

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        except SystemExit:
            self.should_exit = True
            return
        if sockets is not None:  # uvicorn logs where it listens only when it binds the socket itself
            host, port = sockets[0].getsockname()[:2]
            log.info("listening on http://%s:%d", host, port)
        self.up.set()
