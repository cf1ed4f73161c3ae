"""The manifests of the repository models that workers serve, published so that a gateway without the repository
folder can still validate their inputs (``fleet.models.add_published``).

A worker serving a repository entry writes ``{"version", "manifest"}`` under the model's name in one Redis hash
(``MODEL_MANIFESTS_KEY``) before it loads the weights; the last worker to start wins, which is the version being
rolled out. Each version is also kept in a hash of its own per model (``model_manifest_versions_key``: version ->
manifest), so a gateway knows every version workers serve, not only the latest: a traffic policy (canary, shadow)
names versions side by side (``read_version``, ``versions``). A manifest carries no weights, only the schema
choice, batching and cache settings, so publishing it reveals nothing a client of ``GET /v1/models`` could not see.
In memory a dict, for ``fleet up`` on the embedded store.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Protocol

from fleet import constants as c
from fleet.schemas.manifest import ModelManifest
from fleet.store.redis_errors import RedisErrors

if TYPE_CHECKING:
    from fleet.store.redis import RedisStore

Published = tuple[str, ModelManifest]  # (version, manifest)


def _encode(version: str, manifest: ModelManifest) -> str:
    return json.dumps({"version": version, "manifest": manifest.model_dump(mode="json")})


def _decode(raw: str | bytes) -> Published:
    data = json.loads(raw)
    return str(data["version"]), ModelManifest.model_validate(data["manifest"])


class ManifestStore(Protocol):
    async def publish(self, name: str, version: str, manifest: ModelManifest) -> None: ...

    async def read(self, name: str) -> Published | None:
        """The version published last and its manifest (None: none published)."""
        ...

    async def read_version(self, name: str, version: str) -> ModelManifest | None:
        """The manifest of ``name@version`` as published by a worker serving it (None: never published)."""
        ...

    async def versions(self, name: str) -> list[str]:
        """Every version of ``name`` that a worker published (unordered)."""
        ...


class MemoryManifestStore:
    def __init__(self) -> None:
        self._published: dict[str, str] = {}
        self._versions: dict[tuple[str, str], str] = {}

    async def publish(self, name: str, version: str, manifest: ModelManifest) -> None:
        self._published[name] = _encode(version, manifest)
        self._versions[(name, version)] = manifest.model_dump_json()

    async def read(self, name: str) -> Published | None:
        raw = self._published.get(name)
        return _decode(raw) if raw is not None else None

    async def read_version(self, name: str, version: str) -> ModelManifest | None:
        raw = self._versions.get((name, version))
        return ModelManifest.model_validate_json(raw) if raw is not None else None

    async def versions(self, name: str) -> list[str]:
        return [v for (n, v) in self._versions if n == name]


class RedisManifestStore:
    """The manifests hash in the Redis of ``store`` (a ``RedisStore``: its client)."""

    def __init__(self, store: RedisStore) -> None:
        self.redis = store.redis
        self.display_url = store.display_url

    async def publish(self, name: str, version: str, manifest: ModelManifest) -> None:
        async with RedisErrors("model manifests", self.display_url, f"publish the manifest of {name}@{version}"):
            await self.redis.hset(c.MODEL_MANIFESTS_KEY, name, _encode(version, manifest))
            await self.redis.hset(c.model_manifest_versions_key(name), version, manifest.model_dump_json())

    async def read(self, name: str) -> Published | None:
        async with RedisErrors("model manifests", self.display_url, f"read the manifest of {name}"):
            raw = await self.redis.hget(c.MODEL_MANIFESTS_KEY, name)
        return _decode(raw) if raw is not None else None

    async def read_version(self, name: str, version: str) -> ModelManifest | None:
        async with RedisErrors("model manifests", self.display_url, f"read the manifest of {name}@{version}"):
            raw = await self.redis.hget(c.model_manifest_versions_key(name), version)
        return ModelManifest.model_validate_json(raw) if raw is not None else None

    async def versions(self, name: str) -> list[str]:
        async with RedisErrors("model manifests", self.display_url, f"list the published versions of {name}"):
            names = await self.redis.hkeys(c.model_manifest_versions_key(name))
        return [n.decode() if isinstance(n, bytes) else n for n in names]
