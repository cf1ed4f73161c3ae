"""What the ``fleet`` command's modules share: the common options, settings from the environment and flags, the
one-line failure, and running a command's coroutine. A leaf of ``fleet.cli``: the command modules import it, never
the package that registers them.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeGuard

import typer
from rich.console import Console

from fleet.errors import FleetError
from fleet.redaction import redact, url_has_secret
from fleet.telemetry import configure_logging

if TYPE_CHECKING:
    from pydantic import ValidationError

    from fleet.settings import FleetSettings

err = Console(stderr=True)

Broker = Annotated[
    str | None,
    typer.Option("--broker", help="memory://, nats://HOST:4222 or kafka://HOST:9092 (env FLEET_BROKER_URL)"),
]
DEFAULT_URL = "http://127.0.0.1:8000"  # the gateway a client command talks to unless --url / FLEET_URL says
Url = Annotated[str, typer.Option("--url", envvar="FLEET_URL", help="the gateway (env FLEET_URL)")]


def api_key_option(help: str) -> Any:
    """The ``--api-key`` option of a client command (env FLEET_API_KEY), with what the key must be for it."""
    return typer.Option("--api-key", envvar="FLEET_API_KEY", show_envvar=True, help=help)


Store = Annotated[str | None, typer.Option("--store", help="memory:// or redis://HOST:6379/0 (env FLEET_STORE_URL)")]
Auth = Annotated[
    str | None,
    typer.Option(
        "--auth",
        help="off or keys (env FLEET_AUTH); unset: off on a loopback host, and a non-loopback --host is refused",
    ),
]
AppDir = Annotated[
    Path | None,
    typer.Option(
        "--app-dir",
        help="folder your model references ('package.module:Handler') are imported from, like uvicorn's "
        "(env FLEET_APP_DIR; default: the current folder)",
        file_okay=False,
    ),
]
LogLevel = Annotated[
    str | None, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR (env FLEET_LOG_LEVEL)")
]


APP_DIR_ENV = "FLEET_APP_DIR"


def use_app_dir(app_dir: Path | str | None = None) -> None:
    """Import model references from ``app_dir`` (else ``FLEET_APP_DIR``, else the current folder): first on
    ``sys.path``, as ``python -m`` and uvicorn do, and named in the environment so that the processes a command
    starts (``fleet up``'s workers and gateway) import from the same folder wherever they run."""
    named = app_dir or os.environ.get(APP_DIR_ENV)
    chosen = Path(named or ".").resolve()
    if named and not chosen.is_dir():
        raise fail(f"--app-dir / {APP_DIR_ENV} {named}: no such folder")
    os.environ[APP_DIR_ENV] = str(chosen)
    if str(chosen) not in sys.path:
        sys.path.insert(0, str(chosen))


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` (the message as written: brackets in a path or ``fleet-inference[server]`` are not
    markup) and return the exit to raise."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def settings_from(**flags: Any) -> FleetSettings:
    """Environment first, flags on top; a bad value exits with a message naming the setting."""
    overrides = {k: v for k, v in flags.items() if v is not None}
    for name, flag in (("broker_url", "--broker"), ("store_url", "--store")):
        if isinstance(overrides.get(name), str) and url_has_secret(overrides[name]):
            raise fail(
                f"{flag} {redact(overrides[name])}: a password or token on the command line is refused (process "
                "listings and shell history keep it); put it in a file named by FLEET_REDIS_PASSWORD_FILE, "
                "FLEET_NATS_PASSWORD_FILE, FLEET_NATS_CREDS_FILE or FLEET_KAFKA_PASSWORD_FILE (see "
                "docs/guides/real-infrastructure.md)"
            )
    from pydantic import ValidationError  # imported by the commands that read settings, not by `fleet --help`

    from fleet.settings import FleetSettings

    try:
        settings = FleetSettings(**overrides)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()]
        raise fail("invalid settings:\n" + "\n".join(lines)) from None
    except FleetError as exc:
        raise fail(exc.message) from None
    use_model_repository(settings)
    return settings


def with_breaker(settings: FleetSettings, on: bool) -> FleetSettings:
    """``--breaker``: the worker's circuit breaker on (the thresholds of FLEET_WORKER_BREAKER, else the defaults);
    ``--no-breaker``: off."""
    from fleet.lifecycle.breaker import BreakerConfig

    config = (settings.worker_breaker or BreakerConfig()) if on else None
    return settings.model_copy(update={"worker_breaker": config})


def use_model_repository(settings: FleetSettings) -> None:
    """Make the settings' model repository absolute (a relative one is taken from the app folder, and so reaches the
    processes a command starts unchanged) and this process's default for resolving model references."""
    from fleet.models import use_repository
    from fleet.repository.layout import Repository

    base = Path(os.environ.get(APP_DIR_ENV) or ".")
    if not settings.model_repository.is_absolute():
        settings.model_repository = (base / settings.model_repository).resolve()
    if settings.model_public_key is not None and not settings.model_public_key.is_absolute():
        settings.model_public_key = settings.model_public_key.resolve()
    use_repository(Repository.from_settings(settings))


def refuse_open_bind(settings: FleetSettings) -> None:
    """Exit (2) before anything starts when a gateway would listen on a non-loopback host with FLEET_AUTH unset."""
    from fleet.producers.gateway.app import check_auth

    try:
        check_auth(settings)
    except FleetError as exc:
        raise fail(exc.message) from None


def listening(settings: FleetSettings) -> socket.socket:
    """The gateway's socket, bound now: a port in use exits (1) with one line naming it and ``--port``/FLEET_PORT,
    before anything connects or says "ready" (``fleet.cli.ports``)."""
    from fleet.cli.ports import listen_socket

    try:
        return listen_socket(settings.host, settings.port)
    except FleetError as exc:
        raise fail(exc.message, 1) from None


def run(coro: Any, settings: FleetSettings) -> None:
    configure_logging(settings.log_level)
    try:
        import asyncio

        asyncio.run(coro)
    except FleetError as exc:
        raise fail(exc.message, 1) from None
    except ConnectionError as exc:  # a client's error that no Fleet code turned into a message: say whose
        where = f"the broker at {redact(settings.broker_url)} or the store at {redact(settings.store_url)}"
        raise fail(f"a connection to {where} failed: {describe(exc)}", 1) from None


def describe(exc: BaseException) -> str:
    """One line for an error that escaped a command: what went wrong, never a traceback."""
    if isinstance(exc, FleetError):
        return exc.message
    if is_validation_error(exc):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or exc.title
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        return f"invalid {where}: {first['msg']}{more}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {exc}"


def is_validation_error(exc: BaseException) -> TypeGuard[ValidationError]:
    """``exc`` is pydantic's ``ValidationError`` (pydantic is imported only by the commands that validate)."""
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(exc, pydantic.ValidationError)
