"""Scaling state: the single-autoscaler lock, decisions, per-model status and operator overrides.

Contract (``tests/test_scaling_store.py`` runs it on Redis and on the in-memory store):

* ``acquire(owner, ttl_s)`` takes the lock when it is free or expired, renews it when ``owner`` holds it, and
  answers False while another owner holds it. Only the holder renews or releases it (compare-and-renew and
  compare-and-delete scripts on Redis), so an autoscaler that lost the lock cannot take it from its successor.
* ``record`` keeps the ``keep`` newest decisions of a model; ``statuses`` returns each model's latest status with
  its decisions, newest first.
* ``set_overrides`` replaces a model's overrides (``None`` fields removed); ``get_overrides`` of a model never
  overridden is all ``None``.

Redis keys (``fleet.constants``): the status is JSON under ``scale_key(model)``, decisions a list under
``scale_decisions_key(model)``, overrides a hash under ``scale_overrides_key(model)``, the models with state a set
under ``SCALE_MODELS_KEY`` and the lock ``SCALE_LOCK_KEY`` (a string holding the owner's id, with a TTL).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from redis import asyncio as aioredis
from redis.exceptions import RedisError

from fleet import constants as c
from fleet.errors import ConfigError, StoreError
from fleet.links import link_error, redis_options
from fleet.redaction import redact
from fleet.schemas.scaling import DecisionRecord, ScalingOverrides, ScalingStatus

if TYPE_CHECKING:
    from fleet.settings import FleetSettings

log = logging.getLogger(__name__)

# KEYS[1] lock; ARGV: owner, ttl in ms. Renews only the owner's lock.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
# KEYS[1] lock; ARGV[1] owner. Deletes only the owner's lock.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
HINT = "is redis-server running and reachable?"


class ScalingStore(Protocol):
    """Where the autoscaler keeps what must outlive it or be shared with the gateway."""

    scheme: str  # "memory" or "redis"

    async def connect(self) -> None:
        """Raise ``StoreError`` naming the URL when the store cannot be reached."""

    async def close(self) -> None:
        """Idempotent."""

    async def acquire(self, owner: str, ttl_s: float) -> bool:
        """Take or renew the single-autoscaler lock for ``ttl_s``; False while another owner holds it."""

    async def release(self, owner: str) -> None:
        """Free the lock if ``owner`` holds it."""

    async def record(self, decision: DecisionRecord, keep: int = c.DEFAULT_SCALING_DECISIONS_KEPT) -> None:
        """Store a decision, keeping the model's ``keep`` newest."""

    async def put_status(self, status: ScalingStatus) -> None:
        """Replace a model's status (its ``decisions`` field is not stored: ``record`` keeps those)."""

    async def statuses(self) -> list[ScalingStatus]:
        """Every model's latest status with its recent decisions, newest first, sorted by model."""

    async def get_overrides(self, model: str) -> ScalingOverrides: ...

    async def set_overrides(self, model: str, overrides: ScalingOverrides) -> None: ...


def _ttl_ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


class MemoryScalingStore:
    """``ScalingStore`` in this process, for ``fleet up`` with the embedded store: share one instance."""

    scheme = "memory"

    def __init__(self) -> None:
        self._lock_owner: str | None = None
        self._lock_until = 0.0
        self._status: dict[str, ScalingStatus] = {}
        self._decisions: dict[str, deque[DecisionRecord]] = {}
        self._overrides: dict[str, ScalingOverrides] = {}

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def acquire(self, owner: str, ttl_s: float) -> bool:
        ttl_ms = _ttl_ms(ttl_s)
        now = time.monotonic()
        if self._lock_owner not in (None, owner) and now < self._lock_until:
            return False
        self._lock_owner, self._lock_until = owner, now + ttl_ms / 1000
        return True

    async def release(self, owner: str) -> None:
        if self._lock_owner == owner:
            self._lock_owner, self._lock_until = None, 0.0

    async def record(self, decision: DecisionRecord, keep: int = c.DEFAULT_SCALING_DECISIONS_KEPT) -> None:
        kept = self._decisions.setdefault(decision.model, deque())
        kept.appendleft(decision)
        while len(kept) > max(1, keep):
            kept.pop()

    async def put_status(self, status: ScalingStatus) -> None:
        self._status[status.model] = status.model_copy(update={"decisions": []})

    async def statuses(self) -> list[ScalingStatus]:
        return [
            status.model_copy(update={"decisions": list(self._decisions.get(model, ()))})
            for model, status in sorted(self._status.items())
        ]

    async def get_overrides(self, model: str) -> ScalingOverrides:
        return self._overrides.get(model, ScalingOverrides())

    async def set_overrides(self, model: str, overrides: ScalingOverrides) -> None:
        self._overrides[model] = overrides.model_copy()


class RedisScalingStore:
    """``ScalingStore`` on Redis, shared by the autoscaler (writer) and the gateways (readers, overrides).

    Args:
        url: ``redis://[user:password@]host:port/db``.
        lock_key: the lock's key; fleets sharing one Redis database need distinct ones.
        socket_timeout_s: bound on one command, so an outage surfaces as ``StoreError`` instead of a hang.
        link_options: redis-py keywords for the ACL user and TLS (``fleet.links.redis_options``).
    """

    scheme = "redis"

    def __init__(
        self,
        url: str,
        *,
        lock_key: str = c.SCALE_LOCK_KEY,
        socket_timeout_s: float = 5.0,
        link_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.display_url = redact(url)
        self.lock_key = lock_key
        self.redis: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            decode_responses=True,
            **(link_options or {}),
        )
        self._renew = self.redis.register_script(RENEW_LUA)
        self._release = self.redis.register_script(RELEASE_LUA)
        self._closed = False

    async def connect(self) -> None:
        with self._errors("answer PING"):
            await self.redis.ping()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.redis.aclose()

    async def acquire(self, owner: str, ttl_s: float) -> bool:
        ttl_ms = _ttl_ms(ttl_s)
        with self._errors("take the autoscaler lock"):
            if await self.redis.set(self.lock_key, owner, nx=True, px=ttl_ms):
                return True
            return bool(await self._renew(keys=[self.lock_key], args=[owner, ttl_ms]))

    async def release(self, owner: str) -> None:
        with self._errors("release the autoscaler lock"):
            await self._release(keys=[self.lock_key], args=[owner])

    async def record(self, decision: DecisionRecord, keep: int = c.DEFAULT_SCALING_DECISIONS_KEPT) -> None:
        key = c.scale_decisions_key(decision.model)
        with self._errors(f"record a scaling decision of {decision.model!r}"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.lpush(key, decision.model_dump_json())
                pipe.ltrim(key, 0, max(1, keep) - 1)
                pipe.sadd(c.SCALE_MODELS_KEY, decision.model)
                await pipe.execute()

    async def put_status(self, status: ScalingStatus) -> None:
        raw = status.model_dump_json(exclude={"decisions"})
        with self._errors(f"store the scaling status of {status.model!r}"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(c.scale_key(status.model), raw)
                pipe.sadd(c.SCALE_MODELS_KEY, status.model)
                await pipe.execute()

    async def statuses(self) -> list[ScalingStatus]:
        with self._errors("read the scaling statuses"):
            models = sorted(_text(m) for m in await self.redis.smembers(c.SCALE_MODELS_KEY))
            async with self.redis.pipeline(transaction=False) as pipe:
                for model in models:
                    pipe.get(c.scale_key(model))
                    pipe.lrange(c.scale_decisions_key(model), 0, -1)
                replies = await pipe.execute()
        out = []
        for i, model in enumerate(models):
            raw, decisions = replies[2 * i], replies[2 * i + 1]
            status = self._parse_status(model, raw)
            if status is not None:
                status.decisions = [DecisionRecord.model_validate_json(d) for d in decisions]  # newest first
                out.append(status)
        return out

    async def get_overrides(self, model: str) -> ScalingOverrides:
        with self._errors(f"read the scaling overrides of {model!r}"):
            fields = await self.redis.hgetall(c.scale_overrides_key(model))
        return ScalingOverrides.model_validate({_text(k): _parse_field(_text(v)) for k, v in fields.items()})

    async def set_overrides(self, model: str, overrides: ScalingOverrides) -> None:
        key = c.scale_overrides_key(model)
        values = overrides.model_dump()
        with self._errors(f"store the scaling overrides of {model!r}"):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                for name, value in values.items():
                    if value is not None:
                        pipe.hset(key, name, _format_field(value))
                pipe.sadd(c.SCALE_MODELS_KEY, model)
                await pipe.execute()

    @staticmethod
    def _parse_status(model: str, raw: str | None) -> ScalingStatus | None:
        if raw is None:
            return None
        try:
            return ScalingStatus.model_validate_json(raw)
        except ValueError as exc:
            log.warning("scaling status of %s is not readable and is ignored: %s", model, exc)
            return None

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except (TimeoutError, RedisError, OSError) as exc:
            refused = link_error("Redis", self.display_url, exc, "FLEET_REDIS_USER and FLEET_REDIS_PASSWORD_FILE")
            if refused is not None:
                raise refused from None
            raise StoreError(f"scaling store at {self.display_url} could not {action}: {exc}; {HINT}") from exc


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _format_field(value: float | bool) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def _parse_field(value: str) -> float | bool:
    if value in ("true", "false"):
        return value == "true"
    try:
        return int(value)
    except ValueError:
        return float(value)


def make_scaling_store(settings: FleetSettings) -> ScalingStore:
    """The scaling store next to the result store ``settings.store_url`` names (not connected yet).

    ``memory://`` gives a new ``MemoryScalingStore``: the gateway and the autoscaler of one process must share the
    instance the composition root built. Raises ``ConfigError`` for any other scheme than memory/redis/rediss.
    """
    scheme = settings.store_scheme
    if scheme == "memory":
        return MemoryScalingStore()
    if scheme in ("redis", "rediss"):
        return RedisScalingStore(settings.store_url, link_options=redis_options(settings))
    raise ConfigError(
        f"store URL {redact(settings.store_url)!r}: unsupported scheme {scheme!r}; use memory:// or redis://"
    )
