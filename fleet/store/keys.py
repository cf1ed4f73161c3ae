"""API keys: made from ``secrets``, kept as their sha256 digest beside the job records (Redis) or in memory.

A key reads ``fleet_<key id>_<secret>``. The id (12 hex digits) is public: it names the key's record and is what
``fleet keys list`` and the audit log show. The secret (256 random bits) is never stored; the record keeps the
sha256 digest of the whole key, compared with ``hmac.compare_digest``. A slow password hash is not needed: the
secret is random and long, so its digest cannot be searched.

Contract (``tests/test_keys.py`` runs it on Redis and in memory):

* ``create(tenant, role, expires_at)`` returns the key (once) and its ``KeyInfo``.
* ``check(key)`` returns the ``KeyInfo`` of a key whose digest matches, whatever its state (the caller says why
  an expired or revoked key is refused), or None for a malformed, unknown or wrong key.
* ``list()`` is every key, oldest first; ``revoke(key_id)`` marks it revoked (the first revocation time stays) and
  returns its ``KeyInfo``, or None for an unknown id.

Redis keys (``fleet.constants``): ``api_key_key(id)`` a hash per key, ``API_KEYS_KEY`` the set of ids.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from fleet import constants as c
from fleet.errors import ConfigError
from fleet.schemas.keys import KeyInfo, Role
from fleet.store.redis_errors import RedisErrors, text

if TYPE_CHECKING:
    from fleet.store.redis import RedisStore

KEY_RE = re.compile(rf"^{c.API_KEY_PREFIX}_([0-9a-f]{{{2 * c.API_KEY_ID_BYTES}}})_([A-Za-z0-9_-]{{20,100}})$")
DURATION_RE = re.compile(r"^(\d+)\s*([smhdw])$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def new_key() -> tuple[str, str]:
    """(key id, the whole key) of a fresh random key."""
    key_id = secrets.token_hex(c.API_KEY_ID_BYTES)
    return key_id, f"{c.API_KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(c.API_KEY_SECRET_BYTES)}"


def digest(key: str) -> str:
    """The stored form of a key: its sha256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str | None:
    """The id inside a well-formed key, or None."""
    found = KEY_RE.match(key)
    return found.group(1) if found else None


def matches(key: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(key).encode(), stored_digest.encode())


def parse_expiry(value: str | None, now: float) -> float | None:
    """``30d``, ``12h``, ``90m``, ``3600s``, ``2w`` or an ISO-8601 time (UTC when it names no zone) as unix
    seconds; None for None. Raises ``ConfigError`` naming the value when it is neither, or not in the future."""
    if value is None:
        return None
    text_ = value.strip()
    found = DURATION_RE.match(text_.lower())
    if found:
        at = now + int(found.group(1)) * UNIT_S[found.group(2)]
    else:
        try:
            when = datetime.fromisoformat(text_.replace("Z", "+00:00"))
        except ValueError:
            raise ConfigError(
                f"expires {value!r}: not a duration (30d, 12h, 90m, 3600s, 2w) or an ISO-8601 time"
            ) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        at = when.timestamp()
    if at <= now:
        raise ConfigError(f"expires {value!r}: that is not in the future")
    return at


def check_tenant(tenant: str) -> str:
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", tenant):
        raise ConfigError(
            f"tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return tenant


def check_role(role: str) -> Role:
    if role not in c.ROLES:
        raise ConfigError(f"role {role!r}: use one of {', '.join(c.ROLES)}")
    return role  # type: ignore[return-value]


def _info(key_id: str, fields: dict[str, Any]) -> KeyInfo:
    def opt(name: str) -> float | None:
        value = fields.get(name)
        return float(value) if value not in (None, "", b"") else None

    return KeyInfo(
        key_id=key_id,
        prefix=f"{c.API_KEY_PREFIX}_{key_id}_",
        tenant=text(fields["tenant"]),
        role=check_role(text(fields["role"])),
        created_at=float(fields["created_at"]),
        expires_at=opt("expires_at"),
        revoked_at=opt("revoked_at"),
    )


class KeyStore(Protocol):
    async def create(self, tenant: str, role: Role, expires_at: float | None) -> tuple[str, KeyInfo]: ...

    async def check(self, key: str) -> KeyInfo | None: ...

    async def list(self) -> list[KeyInfo]: ...

    async def revoke(self, key_id: str) -> KeyInfo | None: ...


def _record(key: str, tenant: str, role: Role, expires_at: float | None) -> dict[str, str]:
    return {
        "digest": digest(key),
        "tenant": check_tenant(tenant),
        "role": check_role(role),
        "created_at": repr(time.time()),
        "expires_at": "" if expires_at is None else repr(expires_at),
    }  # no revoked_at until a revocation sets it (HSETNX: the first one wins)


class MemoryKeyStore:
    """The keys of ``fleet up`` on the embedded store: one per memory result store."""

    def __init__(self) -> None:
        self._keys: dict[str, dict[str, str]] = {}

    async def create(self, tenant: str, role: Role, expires_at: float | None) -> tuple[str, KeyInfo]:
        key_id, key = new_key()
        self._keys[key_id] = _record(key, tenant, role, expires_at)
        return key, _info(key_id, self._keys[key_id])

    async def check(self, key: str) -> KeyInfo | None:
        key_id = key_id_of(key)
        fields = self._keys.get(key_id) if key_id else None
        if key_id is None or fields is None or not matches(key, fields["digest"]):
            return None
        return _info(key_id, fields)

    async def list(self) -> list[KeyInfo]:
        return sorted((_info(i, f) for i, f in self._keys.items()), key=lambda k: k.created_at)

    async def revoke(self, key_id: str) -> KeyInfo | None:
        fields = self._keys.get(key_id)
        if fields is None:
            return None
        fields.setdefault("revoked_at", repr(time.time()))
        return _info(key_id, fields)


class RedisKeyStore:
    """The keys in the Redis of ``store`` (a ``RedisStore``: its client)."""

    def __init__(self, store: RedisStore) -> None:
        self.redis = store.redis
        self.display_url = store.display_url

    async def create(self, tenant: str, role: Role, expires_at: float | None) -> tuple[str, KeyInfo]:
        key_id, key = new_key()
        record = _record(key, tenant, role, expires_at)
        async with self._errors("create an API key"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(c.api_key_key(key_id), mapping=record)
                pipe.sadd(c.API_KEYS_KEY, key_id)
                await pipe.execute()
        return key, _info(key_id, record)

    async def check(self, key: str) -> KeyInfo | None:
        key_id = key_id_of(key)
        if key_id is None:
            return None
        async with self._errors("check an API key"):
            fields = await self.redis.hgetall(c.api_key_key(key_id))
        fields = {text(k): text(v) for k, v in fields.items()}
        if not fields or not matches(key, fields.get("digest", "")):
            return None
        return _info(key_id, fields)

    async def list(self) -> list[KeyInfo]:
        async with self._errors("list the API keys"):
            ids = sorted(text(i) for i in await self.redis.smembers(c.API_KEYS_KEY))
            async with self.redis.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hgetall(c.api_key_key(key_id))
                replies = await pipe.execute()
        infos = [_info(i, {text(k): text(v) for k, v in r.items()}) for i, r in zip(ids, replies, strict=True) if r]
        return sorted(infos, key=lambda k: k.created_at)

    async def revoke(self, key_id: str) -> KeyInfo | None:
        name = c.api_key_key(key_id)
        async with self._errors("revoke an API key"):
            if not await self.redis.exists(name):
                return None
            await self.redis.hsetnx(name, "revoked_at", repr(time.time()))
            fields = await self.redis.hgetall(name)
        return _info(key_id, {text(k): text(v) for k, v in fields.items()})

    def _errors(self, action: str) -> Any:
        return RedisErrors("key store", self.display_url, action)
