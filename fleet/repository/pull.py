"""``fleet models pull``: a Hugging Face Hub snapshot (or a local snapshot folder) into the repository, with the
sha256 of every file recorded by ``fleet.repository.add``.

The download lands in a hidden folder inside the repository (so the files are moved, not copied, into the version
folder) and is removed whatever happens. Pickled weights are not downloaded (``IGNORED``): they would never be
loaded. A hub that cannot be reached, a repository or revision that does not exist, are one ``ConfigError`` line.
The source and revision are recorded in the manifest's labels.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

from fleet.errors import ConfigError
from fleet.repository.add import Added, add_folder
from fleet.repository.layout import Repository

HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$")
IGNORED = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.h5", "*.msgpack", "*.ot", "*.onnx", "*.tflite", ".git*"]


def parse_source(source: str) -> tuple[str, str | None, Path | None]:
    """``ORG/NAME[@revision]`` as ``(repo id, revision, None)``; ``file:///folder`` as ``(folder name, None,
    folder)``."""
    if source.startswith("file://"):
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"{source}: a file:// source names a folder on this machine (file:///path)")
        folder = Path(unquote(parts.path))
        return folder.name, None, folder
    repo_id, sep, revision = source.partition("@")
    if not HUB_ID_RE.fullmatch(repo_id) or ".." in repo_id:
        raise ConfigError(f"{source!r} is not a Hub model id: write ORG/NAME[@revision], or file:///folder")
    if sep and not REVISION_RE.fullmatch(revision):
        raise ConfigError(f"{source!r}: {revision!r} is not a revision (a branch, tag or commit)")
    return repo_id, revision or None, None


def default_name(repo_id: str) -> str:
    """A model name from the id's last part: ``sentence-transformers/all-MiniLM-L6-v2`` -> ``all-minilm-l6-v2``."""
    name = re.sub(r"[^a-z0-9_-]+", "-", repo_id.rpartition("/")[2].lower()).strip("-_")[:63]
    return name or "model"


def download(repo_id: str, revision: str | None, into: Path) -> str:
    """Download the snapshot into ``into``; returns the revision (``main`` when none was asked for)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors as hub_errors
    except ModuleNotFoundError:
        raise ConfigError("fleet models pull needs the 'models' extra: pip install 'fleet-inference[models]'") from None
    try:
        huggingface_hub.snapshot_download(
            repo_id, revision=revision, local_dir=str(into), ignore_patterns=IGNORED, etag_timeout=10
        )
    except hub_errors.RepositoryNotFoundError:
        raise ConfigError(f"{repo_id}: no such model on the Hugging Face Hub (or it needs a token: HF_TOKEN)") from None
    except hub_errors.RevisionNotFoundError:
        raise ConfigError(f"{repo_id}: no revision {revision!r} on the Hugging Face Hub") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled):
        raise ConfigError(
            f"cannot reach the Hugging Face Hub to pull {repo_id} (no network, or HF_HUB_OFFLINE is set); "
            "download the snapshot elsewhere and use: fleet models pull file:///path/to/folder --name NAME"
        ) from None
    except (hub_errors.HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"pulling {repo_id} from the Hugging Face Hub failed: {first}") from None
    return revision or "main"


def pull(
    repo: Repository,
    source: str,
    *,
    name: str | None = None,
    version: str | None = None,
    runtime: str | None = None,
    task: str | None = None,
    description: str = "",
) -> Added:
    """Pull ``source`` (``ORG/NAME[@revision]`` or ``file:///folder``) into ``repo`` as a new version.

    Raises:
        ConfigError: the source cannot be read or reached, or the snapshot cannot be added (``add_folder``).
    """
    repo_id, revision, folder = parse_source(source)
    name = name or default_name(repo_id)
    if folder is not None:
        labels = {"source": f"file://{folder}"}
        return add_folder(
            repo,
            folder,
            name,
            version=version,
            runtime=runtime,
            task=task,
            description=description,
            labels=labels,
            mode="copy",
        )
    try:
        repo.root.mkdir(parents=True, exist_ok=True)
        into = Path(tempfile.mkdtemp(prefix=".pull.", dir=repo.root))
    except OSError as exc:
        raise ConfigError(f"cannot write into {repo.root}: {exc.strerror or exc}") from None
    try:
        resolved = download(repo_id, revision, into)
        labels = {"source": f"hf:{repo_id}", "revision": resolved}
        return add_folder(
            repo,
            into,
            name,
            version=version,
            runtime=runtime,
            task=task,
            description=description,
            labels=labels,
            mode="move",
        )
    finally:
        shutil.rmtree(into, ignore_errors=True)
