"""Resolve a model reference (a built-in name or ``package.module:Handler``) to its ``ModelSpec``.

Only the spec is read: nothing is loaded onto a device here, so the gateway can validate inputs of models that
run elsewhere.
"""

from __future__ import annotations

import importlib
from typing import Any

from fleet import constants as c
from fleet.errors import ConfigError, UnknownModel
from fleet.schemas.models import BUILTIN_SPECS, ModelSpec


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


def resolve_spec(ref: str) -> ModelSpec:
    if ref in BUILTIN_SPECS:
        return BUILTIN_SPECS[ref]
    if ":" not in ref and "." not in ref:
        raise UnknownModel(ref, list(BUILTIN_SPECS))
    obj = import_object(ref)
    spec = obj if isinstance(obj, ModelSpec) else getattr(obj, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"{ref!r} has no 'spec' attribute of type fleet.schemas.models.ModelSpec")
    check_model_name(spec.name)
    return spec


def check_model_name(name: str) -> str:
    if not c.MODEL_NAME_RE.match(name):
        raise ConfigError(
            f"model name {name!r} is not allowed: use 1-63 lower-case letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return name


def resolve_specs(refs: list[str]) -> dict[str, ModelSpec]:
    specs: dict[str, ModelSpec] = {}
    for ref in refs:
        spec = resolve_spec(ref)
        if spec.name in specs:
            raise ConfigError(f"model {spec.name!r} is configured twice")
        specs[spec.name] = spec
    return specs
