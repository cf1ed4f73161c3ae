"""Model handlers: the built-in ``echo``, ``sleep`` and ``embed``, and ``resolve_handler`` for repository entries
and user models.

See ``fleet.consumers.handlers.base.ModelHandler`` for the interface a user model implements. A repository entry
(``name`` or ``name@version``, ``fleet.repository``) is served by its runtime's handler (``RUNTIME_HANDLER``, imported
only then: resolving ``echo`` imports no torch), or by the handler class its manifest names, whose ``load`` first
checks the entry's files (``verify_entry``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fleet.consumers.handlers.base import ModelHandler
from fleet.errors import ConfigError
from fleet.models import builtin_of, check_model_name, import_object, is_import_path, repository_entry
from fleet.repository.entry import RepositoryEntry
from fleet.repository.layout import Repository
from fleet.repository.verify import verify_entry
from fleet.schemas.models import ModelSpec

# Import paths, not classes: resolving ``echo`` must not import torch.
BUILTIN_HANDLERS: dict[str, str] = {
    "echo": "fleet.consumers.handlers.echo:EchoHandler",
    "sleep": "fleet.consumers.handlers.sleep:SleepHandler",
    "embed": "fleet.consumers.handlers.embed:EmbedHandler",
}

# ``runtime_handler(entry) -> type[ModelHandler]``: the class that serves a runtime entry (torch stays unimported
# until it is called).
RUNTIME_HANDLER = "fleet.consumers.runtimes:runtime_handler"

HandlerClass = type[ModelHandler[Any, Any]]


def resolve_handler(ref: str, repository: Repository | None = None) -> HandlerClass:
    """Find the handler class for a model reference.

    Args:
        ref: a built-in name (``echo``, ``sleep``, ``embed``), a repository entry ``name`` or ``name@version``, or
            an import path ``package.module:Handler`` (``package.module.Handler`` works too).
        repository: the model repository (default: this process's, ``fleet.models.use_repository``).

    Returns:
        The handler class (not an instance; nothing is loaded).

    Raises:
        UnknownModel: ``ref`` is neither a built-in name, a repository entry nor an import path.
        ConfigError: the import path or entry does not resolve, or what it names is not a ``ModelHandler`` subclass
            with a ``spec`` whose name is a valid model name.
    """
    ref = ref.strip()
    builtin = builtin_of(ref)
    if builtin is not None:
        return _checked(BUILTIN_HANDLERS[builtin], import_object(BUILTIN_HANDLERS[builtin]))
    if not is_import_path(ref):
        return entry_handler(repository_entry(ref, repository))
    return _checked(ref, import_object(ref))


def entry_handler(entry: RepositoryEntry) -> HandlerClass:
    """The class serving a repository entry: its runtime's, or the manifest's ``handler`` bound to the entry (served
    under the entry's name and version, its files verified before its own ``load``)."""
    if entry.manifest.handler is None:
        return _checked(entry.ref, import_object(RUNTIME_HANDLER)(entry))
    base = _checked(entry.manifest.handler, import_object(entry.manifest.handler))
    spec = dataclasses.replace(base.spec, name=entry.name, version=entry.version)

    def load(self: ModelHandler[Any, Any]) -> None:
        verify_entry(entry)
        base.load(self)

    attrs = {"spec": spec, "entry": entry, "load": load, "__doc__": f"{base.__name__} serving {entry.ref}"}
    return type(f"{base.__name__}_{entry.name.replace('-', '_')}_{entry.version}", (base,), attrs)


def _checked(ref: str, obj: object) -> HandlerClass:
    if not (isinstance(obj, type) and issubclass(obj, ModelHandler)):
        raise ConfigError(
            f"{ref!r} is {type(obj).__name__} {obj!r}, not a subclass of fleet.consumers.handlers.base.ModelHandler"
        )
    spec = getattr(obj, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"handler {ref!r} has no class attribute 'spec' of type fleet.schemas.models.ModelSpec")
    check_model_name(spec.name)
    if getattr(obj, "__abstractmethods__", None):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise ConfigError(f"handler {ref!r} does not implement {missing}")
    return obj


def with_name(handler_cls: HandlerClass, name: str) -> HandlerClass:
    """The same handler served under another model name (its own subjects, consumer group and records).

    Useful to run two versions side by side, and to give each test or benchmark run a private subject.

    Raises:
        ConfigError: ``name`` is not a valid model name.
    """
    check_model_name(name)
    spec = dataclasses.replace(handler_cls.spec, name=name)
    return type(f"{handler_cls.__name__}_{name.replace('-', '_')}", (handler_cls,), {"spec": spec})


__all__ = ["BUILTIN_HANDLERS", "ModelHandler", "resolve_handler", "with_name"]
