"""Result stores: the ``ResultStore`` seam (``base``), Redis (``redis``) and the embedded one (``memory``); beside
them the DAG store (``dagstore``), the dead-letter store (``deadletters``) and the result caches' store
(``cachestore``: L2 entries and the L3 vector logs), in the same Redis or in memory. Every store writes a job's
record through ``transitions.record_json``: JSON, or packed with its base64 vectors' bytes (``packed``). The
single-Redis client packs its commands with hiredis (``redis_packing``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleet.errors import ConfigError
from fleet.redaction import redact
from fleet.store.base import ResultStore

if TYPE_CHECKING:
    from fleet.settings import FleetSettings

__all__ = ["ResultStore", "make_store"]


def make_store(settings: FleetSettings) -> ResultStore:
    """Build (not connect) the store that ``settings.store_url`` names: ``memory://``, ``redis://``, ``rediss://``,
    or a Redis Cluster: ``redis+cluster://`` / ``rediss+cluster://``.

    The ACL user and TLS come from the ``redis_*`` settings (``fleet.links``). Each call builds a new store; for
    ``memory://`` the gateway and the workers of one process must share the one instance the composition root
    built. Raises ``ConfigError`` for any other scheme.
    """
    scheme = settings.store_scheme
    if scheme == "memory":
        from fleet.store.memory import MemoryStore

        return MemoryStore(job_ttl_s=settings.job_ttl_s)
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        from fleet.links import redis_options
        from fleet.store.redis import RedisStore

        return RedisStore(settings.store_url, job_ttl_s=settings.job_ttl_s, link_options=redis_options(settings))
    raise ConfigError(
        f"store URL {redact(settings.store_url)!r}: unsupported scheme {scheme!r}; "
        "use memory://, redis://, rediss:// or redis+cluster://"
    )
