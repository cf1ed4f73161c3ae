"""The stores of one process, built once beside its result store and passed in like the broker.

A gateway, a worker and ``fleet up`` (which runs both, with the DAG starter, in one process) each build one
``Stores`` from the result store they connected (``Stores.beside``) and hand it to every part that needs a store:
the key store and the audit log of ``FLEET_AUTH=keys``, the per-tenant limits (``quotas``), the DAG store, the dead
letters, the result caches' entries, the published manifests of repository models and the models' traffic policies and
rollout measurements (``rollouts``), and the device-seconds of each tenant, model and version (``usage``). With
Redis each is a view on the result store's own client (one connection); with ``memory://`` each is a fresh
in-memory store, shared by everything in the process because they all hold this one bundle. Nothing is attached
to the result store at run time, and no part reaches through it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from fleet.errors import ConfigError
from fleet.store.audit import AuditLog, MemoryAuditLog, RedisAuditLog
from fleet.store.base import ResultStore
from fleet.store.cachestore import CacheStore, MemoryCacheStore, RedisCacheStore
from fleet.store.dagstore import DagStore, MemoryDagStore, RedisDagStore
from fleet.store.deadletters import DeadLetterStore, MemoryDeadLetterStore, RedisDeadLetterStore
from fleet.store.keys import KeyStore, MemoryKeyStore, RedisKeyStore
from fleet.store.manifests import ManifestStore, MemoryManifestStore, RedisManifestStore
from fleet.store.memory import MemoryStore
from fleet.store.quotas import MemoryQuotas, Quotas, RedisQuotas
from fleet.store.redis import RedisStore
from fleet.store.rollouts import MemoryRolloutStore, RedisRolloutStore, RolloutStore
from fleet.store.usage import MemoryUsageStore, RedisUsageStore, UsageStore


@dataclass(frozen=True, slots=True)
class Stores:
    """The result store and the feature stores beside it (see the module docstring)."""

    results: ResultStore
    keys: KeyStore
    audit: AuditLog
    quotas: Quotas
    dags: DagStore
    dead_letters: DeadLetterStore
    cache: CacheStore
    manifests: ManifestStore
    rollouts: RolloutStore
    usage: UsageStore

    @classmethod
    def beside(cls, results: ResultStore) -> Stores:
        """The feature stores beside ``results``: in its Redis (its client, not connected by them), or in memory.

        Raises:
            ConfigError: ``results`` is neither a ``RedisStore`` nor a ``MemoryStore``.
        """
        if isinstance(results, RedisStore):
            return cls(
                results=results,
                keys=RedisKeyStore(results),
                audit=RedisAuditLog(results),
                quotas=RedisQuotas(results),
                dags=RedisDagStore(results),
                dead_letters=RedisDeadLetterStore(results),
                cache=RedisCacheStore(results.redis, results.display_url),
                manifests=RedisManifestStore(results),
                rollouts=RedisRolloutStore(results),
                usage=RedisUsageStore(results),
            )
        if isinstance(results, MemoryStore):
            # one bundle per memory store, as a Redis holds one set of feature stores: every gateway or worker built
            # on the same in-memory store (fleet up, tests) sees the same keys, runs and cache entries
            if results not in _MEMORY_BUNDLES:
                _MEMORY_BUNDLES[results] = cls(
                    results=results,
                    keys=MemoryKeyStore(),
                    audit=MemoryAuditLog(),
                    quotas=MemoryQuotas(),
                    dags=MemoryDagStore(job_ttl_s=results.job_ttl_s),
                    dead_letters=MemoryDeadLetterStore(),
                    cache=MemoryCacheStore(),
                    manifests=MemoryManifestStore(),
                    rollouts=MemoryRolloutStore(),
                    usage=MemoryUsageStore(),
                )
            return _MEMORY_BUNDLES[results]
        raise ConfigError(f"no feature stores beside a {type(results).__name__} ({results.scheme}://)")


def has_bundle(results: object) -> bool:
    """Whether ``Stores.beside(results)`` can build the feature stores (a ``RedisStore`` or a ``MemoryStore``)."""
    return isinstance(results, RedisStore | MemoryStore)


_MEMORY_BUNDLES: weakref.WeakKeyDictionary[MemoryStore, Stores] = weakref.WeakKeyDictionary()
"""The bundle of each in-memory result store (``Stores.beside``), kept as long as that store lives."""
