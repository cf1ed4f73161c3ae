"""Resolve a model reference to its ``ModelSpec``: a built-in name (``echo``, ``sleep``, ``embed``), a model
repository entry (``name`` or ``name@version``, ``fleet.repository``), or an import path ``package.module:Handler``,
tried in that order.

Only the spec is read: nothing is loaded onto a device here, so the gateway can validate inputs of models that
run elsewhere. A repository entry is served under its plain ``name``; ``@version`` pins the version served (the
spec's ``version``; default: the highest). The repository is the one passed in, else this process's default,
which the CLI sets from the settings (``use_repository``; ``FLEET_MODEL_REPOSITORY``, default ``./models``). A
gateway without the repository folder reads the manifests its workers published (``resolve_served``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet import constants as c
from fleet.errors import ConfigError, UnknownModel, UnservedVersion
from fleet.repository.entry import RepositoryEntry, spec_for
from fleet.repository.layout import Repository, check_model_name, split_ref
from fleet.schemas.models import BUILTIN_SPECS, ModelSpec

if TYPE_CHECKING:
    from fleet.store.manifests import ManifestStore

__all__ = [
    "builtin_of",
    "check_model_name",
    "default_repository",
    "import_object",
    "repository_entry",
    "resolve_served",
    "resolve_spec",
    "resolve_specs",
    "resolve_version",
    "served_spec",
    "use_repository",
]

_repository = Repository("models")


def use_repository(repository: Repository) -> None:
    """Make ``repository`` the default of this process's resolutions (the CLI calls it with the settings')."""
    global _repository
    _repository = repository


def default_repository() -> Repository:
    return _repository


def import_object(path: str) -> Any:
    """Import ``package.module:attribute`` (or ``package.module.attribute``)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{path!r} is not an import path; write it as 'package.module:Handler'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for {path!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None


def is_import_path(ref: str) -> bool:
    return ":" in ref or "." in ref


def repository_entry(ref: str, repository: Repository | None = None) -> RepositoryEntry:
    """The entry ``name`` or ``name@version`` names.

    Raises:
        UnknownModel: no such model in the repository (the known list holds the built-ins and the repository's).
        ConfigError: a bad version, a version that is not there, or a manifest that is refused.
    """
    repo = repository or _repository
    name = ref.partition("@")[0]
    if not c.MODEL_NAME_RE.fullmatch(name) or name not in repo:
        raise UnknownModel(ref, [*BUILTIN_SPECS, *repo.names()])
    return repo.get(*split_ref(ref))


def builtin_of(ref: str) -> str | None:
    """The built-in model (``echo``, ``sleep``, ``embed``) that ``ref`` names, alone or at its one version
    (``embed@1``); None for any other reference. Built-ins come first: a repository entry of the same name is not
    reached.

    Raises:
        UnservedVersion: another version of a built-in (``embed@2``).
    """
    name, sep, version = ref.partition("@")
    spec = BUILTIN_SPECS.get(name)
    if spec is None:
        return None
    if sep and version != spec.version:
        raise UnservedVersion(name, version, spec.version)
    return name


def resolve_spec(ref: str, repository: Repository | None = None) -> ModelSpec:
    """The spec of a built-in name, a repository entry (``name``, ``name@version``) or an import path.

    Raises:
        UnknownModel: ``ref`` is none of them.
        ConfigError: an entry or import path that does not resolve to a valid spec.
    """
    builtin = builtin_of(ref)
    if builtin is not None:
        return BUILTIN_SPECS[builtin]
    if not is_import_path(ref):
        return entry_spec(repository_entry(ref, repository))
    obj = import_object(ref)
    spec = obj if isinstance(obj, ModelSpec) else getattr(obj, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"{ref!r} has no 'spec' attribute of type fleet.schemas.models.ModelSpec")
    check_model_name(spec.name)
    return spec


def entry_spec(entry: RepositoryEntry) -> ModelSpec:
    """A runtime entry's spec (``spec_for``), or the spec of the handler class the entry names, served under the
    entry's name and version."""
    handler = entry.manifest.handler
    if handler is None:
        return spec_for(entry)
    spec = getattr(import_object(handler), "spec", None)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(
            f"model {entry.ref}: handler {handler!r} has no 'spec' of type fleet.schemas.models.ModelSpec"
        )
    return dataclasses.replace(spec, name=entry.name, version=entry.version)


def served_spec(specs: Mapping[str, ModelSpec], ref: str) -> ModelSpec:
    """The served model a job's ``model`` field names: ``name``, or ``name@version`` when that version is the one
    served.

    Raises:
        UnknownModel: no model ``name`` is served (the known list is the served models).
        UnservedVersion: ``name`` is served at another version.
    """
    name, sep, version = ref.partition("@")
    spec = specs.get(name)
    if spec is None:
        raise UnknownModel(ref, list(specs))
    if sep and version != spec.version:
        raise UnservedVersion(name, version, spec.version)
    return spec


def resolve_specs(refs: list[str], repository: Repository | None = None) -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    for ref in refs:
        _add(specs, resolve_spec(ref, repository))
    return specs


def _add(specs: dict[str, ModelSpec], spec: ModelSpec) -> None:
    if spec.name in specs:
        raise ConfigError(f"model {spec.name!r} is configured twice")
    specs[spec.name] = spec


async def resolve_served(
    refs: list[str], repository: Repository | None, manifests: ManifestStore
) -> dict[str, ModelSpec]:
    """``resolve_specs``, where a repository model that is not in this process's repository is read from the
    manifest its workers published (``fleet.store.manifests``): a gateway needs no repository folder.

    Raises:
        UnknownModel: a model neither in the repository nor published.
        ConfigError: as ``resolve_specs``, or ``name@version`` where another version was published.
    """
    repo = repository or _repository
    specs: dict[str, ModelSpec] = {}
    for ref in refs:
        try:
            spec = resolve_spec(ref, repo)
        except UnknownModel:
            if not c.MODEL_NAME_RE.fullmatch(ref.partition("@")[0]):
                raise
            name, version = split_ref(ref)
            published = await manifests.read(name)
            if published is None:
                raise
            if version is not None and published[0] != version:
                raise ConfigError(
                    f"model {name!r}: version {version!r} is not in {repo.root}, and its workers published version "
                    f"{published[0]!r}"
                ) from None
            spec = entry_spec(RepositoryEntry(name, published[0], Path(), Path(), published[1]))  # no files here
        _add(specs, spec)
    return specs


async def resolve_version(
    name: str, version: str, repository: Repository | None, manifests: ManifestStore
) -> ModelSpec:
    """The spec of one version of a served model, for a traffic policy that names it beside the served one: a
    built-in's one version, the repository's entry ``name@version``, else the manifest a worker serving that version
    published (``ManifestStore.read_version``).

    Raises:
        ConfigError: the version is in neither (nor a built-in's; the message names the versions that are), or an
            entry that is there but does not resolve to a valid spec.
    """
    repo = repository or _repository
    builtin = BUILTIN_SPECS.get(name)
    if builtin is not None:
        if version != builtin.version:
            raise ConfigError(f"model {name!r} is built in and has only version {builtin.version!r}, not {version!r}")
        return builtin
    if c.MODEL_NAME_RE.fullmatch(name) and name in repo and version in repo.versions(name):
        return entry_spec(repo.get(name, version))
    manifest = await manifests.read_version(name, version)
    if manifest is None:
        known = sorted({*(repo.versions(name) if name in repo else []), *await manifests.versions(name)})
        raise ConfigError(
            f"model {name!r} has no version {version!r}: it is neither in the repository ({repo.root}) nor published "
            f"by a worker serving it; known versions: {', '.join(known) or 'none'}"
        )
    return entry_spec(RepositoryEntry(name, version, Path(), Path(), manifest))  # no files here
