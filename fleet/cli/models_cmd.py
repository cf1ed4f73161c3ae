"""`fleet models add | list | show | verify | sign | keygen | pull`: the model repository (``FLEET_MODEL_REPOSITORY``,
default ``./models``; ``--repository`` names another).

Each command needs only the base install, except ``pull`` (huggingface-hub) and ``sign``/``keygen`` and signature
checks (cryptography), which name the ``models`` extra when it is missing. Results go to standard output, notes to
standard error; every failure is one ``error: ...`` line and exit code 1 (2 for a bad argument), never a traceback.
"""

# No ``from __future__ import annotations``: typer evaluates the commands' annotations.
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from fleet.cli.common import fail
from fleet.errors import FleetError

if TYPE_CHECKING:  # imported by the commands that use them, not by `fleet --help`
    from fleet.repository.entry import RepositoryEntry
    from fleet.repository.layout import Repository

models_app = typer.Typer(
    help="The model repository: add a folder of weights (sha256 of every file), list, show, verify, sign, pull; "
    "a model's canary on a gateway: rollout, promote, rollback.",
    no_args_is_help=True,
)
err = Console(stderr=True)

RepositoryOption = Annotated[
    Path | None,
    typer.Option(
        "--repository",
        help="the model repository folder (env FLEET_MODEL_REPOSITORY; default: ./models in the app folder)",
        file_okay=False,
    ),
]
RUNTIME_HELP = "embeddings, classification, token-classification or rerank (default: from config.json)"


def _fail(message: str, code: int = 1) -> typer.Exit:
    return fail(message, code)


def _note(message: str) -> None:
    err.print(message, highlight=False, markup=False, soft_wrap=True)


def _repository(path: Path | None, *, signed: bool = True) -> "Repository":
    """The repository ``--repository`` or the settings name; ``signed``: with the settings' public key (readers
    check signatures; writers, which make unsigned versions, do not)."""
    from fleet.cli.common import settings_from
    from fleet.repository.layout import Repository

    settings = settings_from(model_repository=path.resolve() if path is not None else None)
    return Repository(settings.model_repository, settings.model_public_key if signed else None)


def _entries(repo: "Repository", ref: str | None) -> list["RepositoryEntry"]:
    """``NAME@V``: that version; ``NAME``: every version of it; None: every version of every model."""
    from fleet.errors import UnknownModel
    from fleet.repository.layout import split_ref

    if ref is not None:
        name, version = split_ref(ref)
        if version is not None:
            return [repo.get(name, version)]
        if name not in repo:
            raise UnknownModel(name, repo.names())
        return [repo.get(name, v) for v in repo.versions(name)]
    return [repo.get(name, v) for name in repo.names() for v in repo.versions(name)]


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def register(app: typer.Typer) -> None:
    """Add ``fleet models`` to ``app``."""

    @models_app.command("add")
    def add(
        folder: Annotated[Path, typer.Argument(help="a folder of weights (config.json, *.safetensors, tokenizer)")],
        name: Annotated[str, typer.Option("--name", help="the model's name (lower-case letters, digits, - and _)")],
        version: Annotated[
            str | None, typer.Option("--version", help="the new version (default: one past the highest number)")
        ] = None,
        runtime: Annotated[str | None, typer.Option("--runtime", help=RUNTIME_HELP)] = None,
        task: Annotated[str | None, typer.Option("--task", help="the task, for people (e.g. sentiment, ner)")] = None,
        description: Annotated[str, typer.Option("--description", help="what the model is, for people")] = "",
        link: Annotated[
            bool,
            typer.Option(
                "--link/--copy",
                help="--copy (default): copy the files into the repository; --link: leave them in FOLDER "
                "(model.yaml names it)",
            ),
        ] = False,
        repository: RepositoryOption = None,
    ) -> None:
        """Add FOLDER as a new version: a model.yaml with the sha256 of every file, then serve it with
        `fleet up --models NAME`. A folder holding only pickled weights (pytorch_model.bin) is refused."""
        from fleet.repository.add import add_folder

        repo = _repository(repository, signed=False)
        try:
            added = add_folder(
                repo,
                folder,
                name,
                version=version,
                runtime=runtime,
                task=task,
                description=description,
                mode="link" if link else "copy",
            )
        except FleetError as exc:
            raise _fail(exc.message) from None
        for note in added.notes:
            _note(note)
        entry = added.entry
        _note(
            f"added {entry.ref} ({entry.manifest.runtime}, {len(entry.manifest.weights.files)} files) in {entry.folder}"
        )
        typer.echo(entry.ref)

    @models_app.command("list")
    def list_(repository: RepositoryOption = None) -> None:
        """List the models: name, versions, the default version's runtime, the default version (the highest).
        Exit 1, after the table, when a default version's model.yaml is refused."""
        repo = _repository(repository)
        rows = [("name", "versions", "runtime", "default")]
        problems: list[str] = []
        try:
            for name in repo.names():
                versions = repo.versions(name)
                try:
                    runtime = repo.get(name).manifest.runtime
                except FleetError as exc:  # one broken manifest does not hide the other models
                    runtime = "(invalid)"
                    problems.append(exc.message)
                rows.append((name, ", ".join(versions), runtime, versions[-1]))
        except FleetError as exc:
            raise _fail(exc.message) from None
        if len(rows) == 1:
            _note(f"no models in {repo.root} (add one: fleet models add FOLDER --name NAME)")
            return
        _table(rows)
        if problems:
            raise _fail("; ".join(problems))

    @models_app.command("show")
    def show(
        ref: Annotated[str, typer.Argument(help="NAME or NAME@VERSION (default: the highest version)")],
        repository: RepositoryOption = None,
    ) -> None:
        """Show a version's manifest and its files with their sizes (the files' digests are not checked: verify)."""
        import yaml

        from fleet.models import repository_entry
        from fleet.schemas.manifest import SIGNATURE_FILE

        repo = _repository(repository)
        try:
            entry = repository_entry(ref, repo)
        except FleetError as exc:
            raise _fail(exc.message) from None
        manifest = entry.manifest.model_dump(mode="json", exclude={"weights": {"files"}})
        typer.echo(f"# {entry.ref}  folder {entry.folder}  weights {entry.weights_dir}")
        signed = (entry.folder / SIGNATURE_FILE).is_file()
        typer.echo(f"# signature: {'model.yaml.sig' if signed else 'none'}")
        typer.echo(yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True).rstrip())
        rows = [("file", "size", "sha256")]
        for file, digest in sorted(entry.manifest.weights.files.items()):
            path = entry.weights_dir / file
            rows.append((file, _size(path.stat().st_size) if path.is_file() else "missing", digest[:16]))
        _table(rows)

    @models_app.command("verify")
    def verify(
        ref: Annotated[str | None, typer.Argument(help="NAME@VERSION, NAME (every version) or nothing (all)")] = None,
        repository: RepositoryOption = None,
    ) -> None:
        """Check every listed file's sha256 (and the signature, with FLEET_MODEL_PUBLIC_KEY); exit 1 naming the
        first file that does not match."""
        from fleet.repository.verify import verify_entry

        repo = _repository(repository)
        try:
            entries = _entries(repo, ref)
            for entry in entries:
                verify_entry(entry)
                typer.echo(f"{entry.ref}: ok ({len(entry.manifest.weights.files)} files)")
        except FleetError as exc:
            raise _fail(exc.message) from None
        if not entries:
            _note(f"no models in {repo.root}")

    @models_app.command("sign")
    def sign(
        ref: Annotated[str, typer.Argument(help="NAME@VERSION (or NAME: its highest version)")],
        private_key: Annotated[
            Path, typer.Option("--private-key", help="PEM file of an ed25519 private key (fleet models keygen)")
        ],
        repository: RepositoryOption = None,
    ) -> None:
        """Write model.yaml.sig: the ed25519 signature of model.yaml, which lists every file's sha256. Workers
        with FLEET_MODEL_PUBLIC_KEY serve only versions signed by its private key."""
        from fleet.models import repository_entry
        from fleet.repository.signing import sign as sign_bytes
        from fleet.schemas.manifest import MANIFEST_FILE, SIGNATURE_FILE

        repo = _repository(repository, signed=False)
        try:
            entry = repository_entry(ref, repo)
            signature = sign_bytes(
                (entry.folder / MANIFEST_FILE).read_bytes(), private_key.read_bytes(), str(private_key)
            )
            (entry.folder / SIGNATURE_FILE).write_bytes(signature)
        except FleetError as exc:
            raise _fail(exc.message) from None
        except OSError as exc:
            raise _fail(f"{exc.filename or private_key}: {exc.strerror or exc}") from None
        typer.echo(str(entry.folder / SIGNATURE_FILE))

    @models_app.command("keygen")
    def keygen(
        out: Annotated[Path, typer.Argument(help="the private key's file (PEM); the public key goes to OUT.pub")],
    ) -> None:
        """Make an ed25519 key pair for `fleet models sign`: OUT (private, mode 600: keep it off the serving
        machines) and OUT.pub (for FLEET_MODEL_PUBLIC_KEY)."""
        from fleet.repository.signing import generate_key_pair

        public_out = out.with_name(out.name + ".pub")
        try:
            private, public = generate_key_pair()
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never over an existing key
            with os.fdopen(fd, "wb") as f:
                f.write(private)
            public_out.write_bytes(public)
        except FleetError as exc:
            raise _fail(exc.message) from None
        except FileExistsError:
            raise _fail(f"{out} exists already; keygen never writes over a key") from None
        except OSError as exc:
            raise _fail(f"{exc.filename or out}: {exc.strerror or exc}") from None
        _note(f"private key {out} (keep it secret), public key {public_out} (FLEET_MODEL_PUBLIC_KEY)")
        typer.echo(str(public_out))

    @models_app.command("pull")
    def pull(
        source: Annotated[
            str, typer.Argument(help="ORG/NAME[@revision] on the Hugging Face Hub, or file:///path/to/snapshot")
        ],
        name: Annotated[str | None, typer.Option("--name", help="the model's name (default: from SOURCE)")] = None,
        version: Annotated[str | None, typer.Option("--version", help="the new version (default: next number)")] = None,
        runtime: Annotated[str | None, typer.Option("--runtime", help=RUNTIME_HELP)] = None,
        task: Annotated[str | None, typer.Option("--task", help="the task, for people")] = None,
        description: Annotated[str, typer.Option("--description", help="what the model is, for people")] = "",
        repository: RepositoryOption = None,
    ) -> None:
        """Download a Hub snapshot (safetensors, configs, tokenizer; never pickles) into the repository as a new
        version with every file's sha256 and its source recorded; needs the 'models' extra and a network."""
        from fleet.repository.pull import pull as pull_source

        repo = _repository(repository, signed=False)
        try:
            added = pull_source(
                repo, source, name=name, version=version, runtime=runtime, task=task, description=description
            )
        except FleetError as exc:
            raise _fail(exc.message) from None
        for note in added.notes:
            _note(note)
        _note(f"pulled {source} as {added.entry.ref} in {added.entry.folder}")
        typer.echo(added.entry.ref)

    from fleet.cli.models_synth_cmd import register_synth
    from fleet.cli.rollout_cmd import register_rollouts

    register_synth(models_app)
    register_rollouts(models_app)
    from fleet.cli.traffic_cmd import register_traffic

    register_traffic(models_app)
    app.add_typer(models_app, name="models")
