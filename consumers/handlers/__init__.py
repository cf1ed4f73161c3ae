"""Model handlers: the built-in ``echo``, ``sleep`` and ``embed``, and ``resolve_handler`` for user models.

See ``fleet.consumers.handlers.base.ModelHandler`` for the interface a user model implements.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fleet.consumers.handlers.base import ModelHandler
from fleet.errors import ConfigError, UnknownModel
from fleet.models import check_model_name, import_object
from fleet.schemas.models import ModelSpec

# Import paths, not classes: resolving ``echo`` must not import torch.
BUILTIN_HANDLERS: dict[str, str] = {
    "echo": "fleet.consumers.handlers.echo:EchoHandler",
    "sleep": "fleet.consumers.handlers.sleep:SleepHandler",
    "embed": "fleet.consumers.handlers.embed:EmbedHandler",
}

HandlerClass = type[ModelHandler[Any, Any]]


def resolve_handler(ref: str) -> HandlerClass:
    """Find the handler class for a model reference.

    Args:
        ref: a built-in name (``echo``, ``sleep``, ``embed``) or an import path ``package.module:Handler``
            (``package.module.Handler`` works too).

    Returns:
        The handler class (not an instance; nothing is loaded).

    Raises:
        UnknownModel: ``ref`` is neither a built-in name nor an import path.
        ConfigError: the import path does not resolve, or what it names is not a ``ModelHandler`` subclass with a
            ``spec`` whose name is a valid model name.
    """
    ref = ref.strip()
    if ref in BUILTIN_HANDLERS:
        return _checked(BUILTIN_HANDLERS[ref], import_object(BUILTIN_HANDLERS[ref]))
    if ":" not in ref and "." not in ref:
        raise UnknownModel(ref, list(BUILTIN_HANDLERS))
    return _checked(ref, import_object(ref))


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
