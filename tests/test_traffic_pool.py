"""What a multi-model worker does for traffic policies: it publishes the manifest of every version an unpinned
repository model serves (the default last, so it stays the one ``read`` gives), so a gateway without the
repository folder resolves the versions a policy names; and its workers carry the settle hook that counts
outcomes per version and compares shadows."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.cli.compose import publish_manifest
from fleet.cli.pool_workers import build_pool_worker, plan_pool, publish_other_versions
from fleet.consumers.pool import ModelPool
from fleet.consumers.version_outcomes import VersionOutcomes
from fleet.errors import ConfigError
from fleet.models import resolve_version
from fleet.repository.layout import Repository
from fleet.startup import Deadline
from fleet.store.bundle import Stores
from tests.infra import connected_pair, settings_for
from tests.traffic_fixtures import versioned_model


async def test_every_served_version_is_published_and_resolves_without_the_folder(tmp_path: Path, unique: str) -> None:
    name = f"pv-{unique}"
    root = versioned_model(tmp_path / "models", name)
    settings = settings_for("memory", {}, model_repository=root)
    plan = plan_pool(settings, [name], None)
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        deadline = Deadline.after(10)
        await publish_other_versions(stores, plan, Repository(root), deadline)
        for handler in plan.handlers:
            await publish_manifest(stores, handler, deadline)
        assert sorted(await stores.manifests.versions(name)) == ["1", "2", "3"]
        latest = await stores.manifests.read(name)
        assert latest is not None and latest[0] == "3"  # the default stays the one published last
        elsewhere = Repository(tmp_path / "no-folder-here")  # a gateway without the repository
        spec = await resolve_version(name, "1", elsewhere, stores.manifests)
        assert (spec.name, spec.version) == (name, "1")
        with pytest.raises(ConfigError, match=r"no version '7'.*known versions: 1, 2, 3"):
            await resolve_version(name, "7", elsewhere, stores.manifests)
        pool = ModelPool(None)
        worker = build_pool_worker(plan.served[0], plan.handlers[0], pool, broker, store, settings, stores)
        hooks = [getattr(hook, "__self__", None) for hook in worker.settler.on_settled]
        assert any(isinstance(h, VersionOutcomes) for h in hooks)
        await pool.close()
