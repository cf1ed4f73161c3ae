"""`fleet keys create | list | revoke`: API keys in the store the settings name (``--store``, ``FLEET_STORE_URL``).

``create`` prints the new key once, alone on the last line of standard output (``KEY=$(fleet keys create ...
| tail -n1)``); what it says about the key goes to standard error. ``list`` never shows a key, only its id and
prefix. Every failure is one ``error: ...`` line: 2 for a bad argument, 1 for a store that cannot be reached or an
unknown key id. Creating and revoking are written to the audit log (actor ``cli``).
"""

# No ``from __future__ import annotations``: typer evaluates the commands' annotations.
import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

from fleet.errors import ConfigError, FleetError

if TYPE_CHECKING:  # the settings module is imported by the command that needs it, not by `fleet --help`
    from fleet.settings import FleetSettings

keys_app = typer.Typer(help="API keys: create, list and revoke them (FLEET_AUTH=keys).", no_args_is_help=True)
err = Console(stderr=True)
T = TypeVar("T")
COLUMNS = ("id", "prefix", "tenant", "role", "created", "expires", "revoked", "status")

MEMORY_HINT = (
    "the store is memory://, whose keys live inside the 'fleet up' process: pass --store redis://... "
    "(env FLEET_STORE_URL), or create keys through POST /v1/keys with the admin key 'fleet up' printed"
)


def _fail(message: str, code: int) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True, soft_wrap=True)
    return typer.Exit(code)


def _with_keys(settings: "FleetSettings", action: Callable[[Any, Any], Awaitable[T]]) -> T:
    """Connect the store of ``settings``, run ``action(key_store, audit_log)``, close; failures end as one line."""
    from fleet.store import make_store
    from fleet.store.bundle import Stores

    if settings.store_scheme == "memory":
        raise _fail(MEMORY_HINT, 2)

    async def go() -> T:
        store = make_store(settings)
        try:
            await store.connect()
            stores = Stores.beside(store)
            return await action(stores.keys, stores.audit)
        finally:
            await store.close()

    try:
        return asyncio.run(go())
    except ConfigError as exc:
        raise _fail(exc.message, 2) from None
    except FleetError as exc:
        raise _fail(exc.message, 1) from None


def _when(at: float | None) -> str:
    return "-" if at is None else datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _audit(log: Any, action: str, target: str, details: dict[str, Any]) -> None:
    from fleet.schemas.keys import AuditEntry

    await log.append(AuditEntry(at=time.time(), action=action, actor="cli", target=target, details=details))


def register(app: typer.Typer) -> None:
    """Add ``fleet keys`` to ``app``."""
    from fleet.cli.common import Store, settings_from

    @keys_app.command("create")
    def create(
        tenant: Annotated[str, typer.Option("--tenant", help="the tenant the key's jobs and runs belong to")],
        role: Annotated[str, typer.Option("--role", help="submitter, operator or admin")],
        expires: Annotated[
            str | None, typer.Option("--expires", help="a duration (30d, 12h, 90m) or an ISO-8601 time; default never")
        ] = None,
        store: Store = None,
    ) -> None:
        """Create a key and print it once, alone on the last line of standard output (it is stored hashed)."""
        from fleet.store.keys import check_role, check_tenant, parse_expiry

        settings = settings_from(store_url=store)
        try:
            checked_role, expires_at = check_role(role), parse_expiry(expires, time.time())
            check_tenant(tenant)
        except ConfigError as exc:
            raise _fail(exc.message, 2) from None

        async def action(keys: Any, log: Any) -> tuple[str, Any]:
            key, info = await keys.create(tenant, checked_role, expires_at)
            await _audit(log, "key.create", info.key_id, {"tenant": tenant, "role": checked_role})
            return key, info

        key, info = _with_keys(settings, action)
        err.print(
            f"created key {info.key_id} (tenant {info.tenant}, role {info.role}, expires {_when(info.expires_at)}); "
            "it is shown once: store it now",
            highlight=False,
            markup=False,
        )
        typer.echo(key)

    @keys_app.command("list")
    def list_(store: Store = None) -> None:
        """List keys (id, prefix, tenant, role, created, expires, status); never the keys themselves."""
        settings = settings_from(store_url=store)

        async def action(keys: Any, log: Any) -> list[Any]:
            found: list[Any] = await keys.list()
            return found

        infos = _with_keys(settings, action)
        if not infos:
            err.print("no API keys", highlight=False)
            return
        now = time.time()
        rows = [COLUMNS] + [
            (
                i.key_id,
                i.prefix,
                i.tenant,
                i.role,
                _when(i.created_at),
                _when(i.expires_at),
                _when(i.revoked_at),
                i.status(now),
            )
            for i in infos
        ]
        widths = [max(len(row[n]) for row in rows) for n in range(len(COLUMNS))]
        for row in rows:
            typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())

    @keys_app.command("revoke")
    def revoke(
        key_id: Annotated[str, typer.Argument(help="the key's id, as 'fleet keys list' shows it")],
        store: Store = None,
    ) -> None:
        """Revoke a key: from now on it answers 401 key_revoked (revoking it again changes nothing)."""
        settings = settings_from(store_url=store)

        async def action(keys: Any, log: Any) -> Any:
            info = await keys.revoke(key_id)
            if info is not None:
                await _audit(log, "key.revoke", key_id, {"tenant": info.tenant, "role": info.role})
            return info

        info = _with_keys(settings, action)
        if info is None:
            raise _fail(f"no API key with id {key_id!r} (see 'fleet keys list')", 1)
        err.print(f"revoked key {key_id} (tenant {info.tenant}, role {info.role})", highlight=False, markup=False)

    app.add_typer(keys_app, name="keys")
