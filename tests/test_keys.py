"""API keys: the key store contract on Redis and in memory, the audit log, expiry parsing, and ``fleet keys``
(create prints the key alone on the last line, list never shows a key, revoke works, errors are one line)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from typer.testing import CliRunner

from fleet import constants as c
from fleet.cli import app as cli_app
from fleet.errors import ConfigError
from fleet.schemas.keys import AuditEntry
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.audit import AuditLog
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from fleet.store.keys import KEY_RE, KeyStore, digest, parse_expiry

STORES = ["memory", "redis"]


@contextlib.asynccontextmanager
async def opened(kind: str, request: Any) -> AsyncIterator[ResultStore]:
    url = "memory://" if kind == "memory" else request.getfixturevalue("redis_url")
    store = make_store(FleetSettings(store_url=url))
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


@pytest.mark.parametrize("kind", STORES)
async def test_key_store_contract(kind: str, request: Any) -> None:
    async with opened(kind, request) as store:
        keys: KeyStore = Stores.beside(store).keys
        key, info = await keys.create("team-a", "operator", None)
        assert KEY_RE.match(key) and key.startswith(info.prefix)
        assert (info.tenant, info.role, info.expires_at, info.revoked_at) == ("team-a", "operator", None, None)
        assert await keys.check(key) == info
        # a wrong secret under a real id, a malformed key and an unknown id are all "not a key"
        assert await keys.check(key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")) is None
        assert await keys.check("not-a-key") is None
        assert await keys.check(f"fleet_{'0' * 12}_{'x' * 43}") is None
        assert info.key_id in {k.key_id for k in await keys.list()}
        revoked = await keys.revoke(info.key_id)
        assert revoked is not None and revoked.revoked_at is not None and revoked.status(time.time()) == "revoked"
        again = await keys.revoke(info.key_id)
        assert again is not None and again.revoked_at == revoked.revoked_at  # the first revocation time stays
        assert await keys.revoke("0" * 12) is None
        checked = await keys.check(key)
        assert checked is not None and checked.status(time.time()) == "revoked"
        expiring, soon = await keys.create("team-b", "submitter", time.time() + 0.05)
        assert soon.status(time.time() + 1) == "expired"
        assert expiring not in repr(await keys.list())


async def test_redis_keeps_only_the_digest(redis_url: str) -> None:
    async with _redis(redis_url) as store:
        key, info = await Stores.beside(store).keys.create("t", "admin", None)
        fields = await store.redis.hgetall(c.api_key_key(info.key_id))  # type: ignore[attr-defined]
        values = {(v.decode() if isinstance(v, bytes) else v) for v in fields.values()}
        assert key not in values and digest(key) in values
        assert key.split("_", 2)[2] not in " ".join(values)


@contextlib.asynccontextmanager
async def _redis(url: str) -> AsyncIterator[ResultStore]:
    store = make_store(FleetSettings(store_url=url))
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


@pytest.mark.parametrize("kind", STORES)
async def test_audit_log_newest_first(kind: str, request: Any, unique: str) -> None:
    async with opened(kind, request) as store:
        log: AuditLog = Stores.beside(store).audit
        for n in range(3):
            await log.append(AuditEntry(at=time.time(), action="scaling.update", actor="test", target=f"{unique}-{n}"))
        latest = await log.latest(2)
        assert [e.target for e in latest] == [f"{unique}-2", f"{unique}-1"]


@pytest.mark.parametrize(
    ("value", "offset"),
    [("30d", 30 * 86400), ("12h", 12 * 3600), ("90m", 5400), ("3600s", 3600), ("2w", 14 * 86400)],
)
def test_durations(value: str, offset: int) -> None:
    assert parse_expiry(value, 1000.0) == 1000.0 + offset


def test_iso_times_and_refusals() -> None:
    assert parse_expiry("2100-01-01T00:00:00Z", 0) == 4102444800.0
    assert parse_expiry("2100-01-01T00:00:00", 0) == 4102444800.0  # no zone: UTC
    assert parse_expiry(None, 0) is None
    for bad in ("soon", "30x", "2000-01-01T00:00:00Z", "-5d"):
        with pytest.raises(ConfigError, match="expires"):
            parse_expiry(bad, time.time())


# -- the CLI --------------------------------------------------------------------------------------------------
def cli(*args: str) -> Any:
    return CliRunner().invoke(cli_app, list(args), prog_name="fleet")


def one_error_line(result: Any, code: int, *needles: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_create_list_revoke(redis_url: str, unique: str) -> None:
    created = cli("keys", "create", "--tenant", unique, "--role", "submitter", "--expires", "30d", "--store", redis_url)
    assert created.exit_code == 0, created.stderr
    key = created.stdout.rstrip("\n").splitlines()[-1]
    assert KEY_RE.match(key) and created.stdout == key + "\n"  # alone, on the last line
    key_id = KEY_RE.match(key).group(1)  # type: ignore[union-attr]
    assert key_id in created.stderr and key not in created.stderr

    listed = cli("keys", "list", "--store", redis_url)
    assert listed.exit_code == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if key_id in line)
    assert unique in row and "submitter" in row and "active" in row
    assert key not in listed.stdout and key.split("_", 2)[2] not in listed.stdout

    revoked = cli("keys", "revoke", key_id, "--store", redis_url)
    assert revoked.exit_code == 0, revoked.stderr
    row = next(line for line in cli("keys", "list", "--store", redis_url).stdout.splitlines() if key_id in line)
    assert "revoked" in row

    async def audited() -> list[AuditEntry]:
        async with _redis(redis_url) as store:
            return await Stores.beside(store).audit.latest(50)

    actions = {(e.action, e.target, e.actor) for e in asyncio.run(audited())}
    assert {("key.create", key_id, "cli"), ("key.revoke", key_id, "cli")} <= actions


def test_cli_errors_are_one_line(redis_url: str) -> None:
    one_error_line(cli("keys", "create", "--tenant", "t", "--role", "root", "--store", redis_url), 2, "role 'root'")
    one_error_line(cli("keys", "create", "--tenant", "t", "--role", "admin", "--expires", "soon"), 2, "expires")
    one_error_line(cli("keys", "create", "--tenant", "bad tenant!", "--role", "admin"), 2, "tenant")
    one_error_line(cli("keys", "revoke", "0" * 12, "--store", redis_url), 1, "no API key")
    one_error_line(cli("keys", "list", "--store", "memory://"), 2, "fleet up")
    one_error_line(cli("keys", "list", "--store", "redis://127.0.0.1:1/0"), 1, "127.0.0.1:1")


async def test_fleet_up_bootstraps_one_admin_key_on_the_embedded_store(capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.cli.serving import bootstrap_admin_key

    async with opened("memory", None) as store:
        keys = Stores.beside(store).keys
        await bootstrap_admin_key(keys)
        printed = capsys.readouterr()
        key = printed.err.strip().rsplit(" ", 1)[-1]
        info = await keys.check(key)
        assert info is not None and info.role == "admin" and info.status(time.time()) == "active"
        assert key not in printed.out
