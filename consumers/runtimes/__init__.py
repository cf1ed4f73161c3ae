"""Task runtimes: serve a model repository entry with no code (``embeddings``, ``classification``,
``token-classification``, ``rerank``).

``runtime_handler(entry)`` makes the ``ModelHandler`` class that serves one entry: the runtime's class with the
entry bound and ``spec = spec_for(entry)``. Making it imports neither torch nor transformers; the class's ``load``
does (see ``fleet.consumers.runtimes.base`` for what a load checks). The schemas of each runtime are in
``fleet.schemas.runtimes``; the forward passes they share are in ``fleet.consumers.runtimes.passes``.
"""

from __future__ import annotations

from typing import Any

from fleet.consumers.handlers.base import ModelHandler
from fleet.errors import ConfigError
from fleet.models import check_model_name, import_object
from fleet.repository.entry import RepositoryEntry, spec_for

# Import paths, not classes: making a handler class must not import torch.
RUNTIME_CLASSES: dict[str, str] = {
    "embeddings": "fleet.consumers.runtimes.embeddings:EmbeddingsRuntime",
    "classification": "fleet.consumers.runtimes.classification:ClassificationRuntime",
    "token-classification": "fleet.consumers.runtimes.token_classification:TokenClassificationRuntime",
    "rerank": "fleet.consumers.runtimes.rerank:RerankRuntime",
}


def runtime_class(runtime: str) -> type[ModelHandler[Any, Any]]:
    """The runtime's (unbound) handler class.

    Raises:
        ConfigError: no runtime of that name.
    """
    if runtime not in RUNTIME_CLASSES:
        raise ConfigError(f"unknown runtime {runtime!r}; known: {', '.join(RUNTIME_CLASSES)}")
    cls: type[ModelHandler[Any, Any]] = import_object(RUNTIME_CLASSES[runtime])
    return cls


def runtime_handler(entry: RepositoryEntry) -> type[ModelHandler[Any, Any]]:
    """The handler class that serves ``entry`` with its runtime: ``spec = spec_for(entry)``, the entry bound.

    Nothing is loaded: the worker constructs the class with its device and calls ``load``.

    Raises:
        ConfigError: the entry's name is not a valid model name, it is served by a handler class rather than a
            runtime, or its options do not fit the runtime.
    """
    check_model_name(entry.name)
    if entry.manifest.runtime not in RUNTIME_CLASSES:
        raise ConfigError(
            f"model {entry.ref} is served by its handler class {entry.manifest.handler}, not by a runtime"
        )
    base = runtime_class(entry.manifest.runtime)
    spec = spec_for(entry)  # the gateway's spec too: a token budget by default (DEFAULT_MAX_BATCH_TOKENS)
    name = f"{base.__name__}_{entry.name.replace('-', '_')}_{entry.version}"
    cls: type[ModelHandler[Any, Any]] = type(name, (base,), {"spec": spec, "entry": entry})
    cls.parse_options(entry)  # type: ignore[attr-defined]  # a bad option fails here, not at load
    return cls


__all__ = ["RUNTIME_CLASSES", "runtime_class", "runtime_handler"]
