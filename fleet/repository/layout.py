"""Reading a model repository folder: ``<root>/<name>/<version>/model.yaml`` (and the weights beside it or where
the manifest points), its versions in order, and each entry's manifest, parsed and checked.

- Names are model names (``check_model_name``, which ``fleet.models`` re-exports), versions match ``VERSION_RE``:
  neither can hold a ``/`` or ``..``, so no reference reaches outside the root. Folders that are neither are not
  listed.
- Version order: numbers compare as numbers and rank above names, names compare as text; the highest is the
  default (``get(name)``).
- ``model.yaml`` is read only when it is a regular file of at most ``MAX_MANIFEST_BYTES``, with the DAG specs'
  depth-bounded safe YAML loader (``fleet.dags.limits``) and the same bound on the values aliases expand to; every
  refusal is one ``ConfigError`` naming the file and the field (``models/x/1/model.yaml: batching.max_batch: ...``).
- With a public key (``FLEET_MODEL_PUBLIC_KEY``), an entry is read only when ``model.yaml.sig`` holds a valid
  ed25519 signature of the manifest's bytes (``fleet.repository.signing``); the manifest is parsed from the bytes
  that were checked, so what is served is what was signed.
- The weights folder: ``weights.path`` (relative to the version folder, or absolute), ``weights.package`` (an
  installed package's ``get_model_path()``, else its folder), or the version folder itself. Nothing here reads a
  weight file: the gateway reads entries without holding weights; ``fleet.repository.verify`` checks them.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from fleet import constants as c
from fleet.dags import limits
from fleet.errors import ConfigError, UnknownModel
from fleet.repository.entry import RepositoryEntry
from fleet.schemas.manifest import MANIFEST_FILE, SIGNATURE_FILE, VERSION_RE, ModelManifest

if TYPE_CHECKING:
    from fleet.settings import FleetSettings

MAX_MANIFEST_BYTES = 1 << 20
"""A model.yaml larger than this is refused before it is read (a manifest of 10,000 files is about 1 MB)."""
MAX_MANIFEST_VALUES = 50_000
PACKAGE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def version_key(version: str) -> tuple[int, int, str]:
    """Sort key of a version: numbers by value, above names, which sort as text."""
    return (1, int(version), "") if version.isdigit() else (0, 0, version)


def check_version(version: str) -> str:
    if not VERSION_RE.fullmatch(version):
        raise ConfigError(
            f"model version {version!r} is not allowed: use 1-32 lower-case letters, digits or '_', "
            "starting with a letter or digit (e.g. 1, 2, 2024_06)"
        )
    return version


def check_model_name(name: str) -> str:
    """``name`` when it is a model name (a subject token and a Redis key), else ``ConfigError``."""
    if not c.MODEL_NAME_RE.fullmatch(name):
        raise ConfigError(
            f"model name {name!r} is not allowed: use 1-63 lower-case letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return name


def split_ref(ref: str) -> tuple[str, str | None]:
    """``name`` or ``name@version`` as ``(name, version or None)``, both checked."""
    name, sep, version = ref.partition("@")
    check_model_name(name)
    return name, (check_version(version) if sep else None)


class Repository:
    """A model repository folder. ``public_key``: PEM bytes of the ed25519 key every entry must be signed with
    (None: signatures are not required)."""

    def __init__(self, root: Path | str, public_key: bytes | Path | None = None) -> None:
        """``public_key``: the PEM bytes, or a file holding them (read when the first entry is)."""
        self.root = Path(root)
        self._public_key = public_key

    @classmethod
    def from_settings(cls, settings: FleetSettings) -> Repository:
        """The repository ``settings`` name (``model_repository``, ``model_public_key``)."""
        return cls(settings.model_repository, settings.model_public_key)

    @property
    def public_key(self) -> bytes | None:
        if isinstance(self._public_key, Path):
            self._public_key = read_public_key(self._public_key)
        return self._public_key

    def __repr__(self) -> str:
        return f"Repository({str(self.root)!r})"

    def names(self) -> list[str]:
        """The models that have at least one version, sorted."""
        if not self.root.is_dir():
            return []
        found = (p.name for p in self.root.iterdir() if c.MODEL_NAME_RE.fullmatch(p.name) and p.is_dir())
        return sorted(name for name in found if self.versions(name))

    def versions(self, name: str) -> list[str]:
        """``name``'s versions, lowest first (the last is the default); [] for a model that is not here."""
        folder = self.root / check_model_name(name)
        if not folder.is_dir():
            return []
        found = [p.name for p in folder.iterdir() if VERSION_RE.fullmatch(p.name) and (p / MANIFEST_FILE).is_file()]
        return sorted(found, key=version_key)

    def __contains__(self, name: str) -> bool:
        return bool(c.MODEL_NAME_RE.fullmatch(name)) and bool(self.versions(name))

    def get(self, name: str, version: str | None = None) -> RepositoryEntry:
        """``name`` at ``version`` (default: its highest), read and checked; nothing is loaded.

        Raises:
            UnknownModel: no model ``name`` here (the known list is this repository's models).
            ConfigError: a bad name or version, a version that is not here, or a manifest that is refused.
        """
        check_model_name(name)
        versions = self.versions(name)
        if not versions:
            raise UnknownModel(name, self.names())
        if version is None:
            version = versions[-1]
        elif check_version(version) not in versions:
            raise ConfigError(
                f"model {name!r} has no version {version!r} in {self.root}; versions: {', '.join(versions)}"
            )
        folder = self.root / name / version
        manifest = read_manifest(folder / MANIFEST_FILE, self.public_key)
        return RepositoryEntry(name, version, folder, weights_dir(folder, manifest), manifest)

    def resolve(self, ref: str) -> RepositoryEntry:
        """``name`` or ``name@version``."""
        name, version = split_ref(ref)
        return self.get(name, version)


def read_public_key(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"model_public_key (FLEET_MODEL_PUBLIC_KEY) {path}: {exc.strerror or exc}") from None


def read_manifest(path: Path, public_key: bytes | None = None) -> ModelManifest:
    """Parse and check one ``model.yaml`` (and its signature when ``public_key`` is given).

    Raises:
        ConfigError: one line naming ``path`` and the field or the limit.
    """
    data = _read_bytes(path)
    if public_key is not None:
        from fleet.repository.signing import check_signature

        check_signature(path, data, path.with_name(SIGNATURE_FILE), public_key)
    return parse_manifest(data, str(path))


def parse_manifest(data: bytes, where: str) -> ModelManifest:
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None
    try:
        raw = limits.load_yaml(text)
    except limits.LimitExceeded as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{where}: {at}{exc.problem or exc} (not valid YAML)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None
    problem = limits.value_problem(raw, MAX_MANIFEST_VALUES)
    if problem is not None:
        loc, why = problem
        raise ConfigError(f"{where}: {_dotted(loc) + ': ' if loc else ''}{why}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a mapping of fields (runtime, weights, ...) was expected, not {_kind(raw)}")
    try:
        return ModelManifest.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {manifest_problem(exc)}") from None


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a version folder holds a {MANIFEST_FILE})")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes, over the limit of {MAX_MANIFEST_BYTES:,} for a manifest")
    try:
        with path.open("rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1)[:MAX_MANIFEST_BYTES]
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None


def manifest_problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = _dotted(first["loc"])
    message = "a required field is missing" if first["type"] == "missing" else first["msg"]
    if first["type"] == "extra_forbidden":
        message = "not a field of model.yaml"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where + ': ' if where else ''}{message.removeprefix('Value error, ')}{more}"


def _dotted(loc: tuple[Any, ...] | list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _kind(value: object) -> str:
    return "a list" if isinstance(value, list) else ("nothing" if value is None else f"a {type(value).__name__}")


def weights_dir(folder: Path, manifest: ModelManifest) -> Path:
    """The folder the entry's weights are read from (not checked to exist: ``verify_entry`` names what is missing)."""
    weights = manifest.weights
    if weights.package is not None:
        return package_path(weights.package, f"{folder / MANIFEST_FILE}: weights.package")
    if weights.path is not None:
        return folder / weights.path
    return folder


def package_path(package: str, where: str) -> Path:
    """An installed package's model folder: its ``get_model_path()``, else the package's own folder."""
    if not PACKAGE_RE.fullmatch(package):
        raise ConfigError(f"{where}: {package!r} is not a package name")
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise ConfigError(f"{where}: package {package!r} is not installed ({exc})") from None
    getter: Callable[[], Any] | None = getattr(module, "get_model_path", None)
    if callable(getter):
        return Path(getter())
    if module.__file__ is None:
        raise ConfigError(f"{where}: package {package!r} has no folder and no get_model_path()")
    return Path(module.__file__).parent
