"""The listening sockets of Fleet's HTTP servers, bound before anything else starts.

``fleet up``, ``fleet gateway`` and ``fleet dispatcher`` bind their port first and hand the socket to uvicorn, so
a port that another process holds is one ``error:`` line that names the port and the setting to change, before
anything connects, starts workers or says "ready" (uvicorn on its own logs the bind error after the app started,
then exits with a traceback). ``SO_REUSEADDR`` is set as uvicorn sets it: a port left in ``TIME_WAIT`` by a
process that just stopped is free, one with a listener is not.
"""

from __future__ import annotations

import socket

from fleet.errors import ConfigError


class PortInUse(ConfigError):
    """The port cannot be bound: in use by another process, or not allowed."""

    def __init__(self, host: str, port: int, reason: str, setting: str) -> None:
        super().__init__(
            f"cannot listen on {host}:{port}: {reason}; another process may be serving there: stop it, or pick "
            f"another port with {setting}"
        )
        self.host, self.port, self.setting = host, port, setting


def listen_socket(host: str, port: int, setting: str = "--port or FLEET_PORT") -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening), for ``uvicorn.Server.serve(sockets=[...])``.

    Raises:
        PortInUse: the address cannot be bound; the message names ``setting``, the way to choose another port.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise PortInUse(host, port, f"unknown host ({exc.strerror})", setting.replace("port", "host")) from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise PortInUse(host, port, exc.strerror or str(exc), setting) from exc
    sock.set_inheritable(True)
    return sock
