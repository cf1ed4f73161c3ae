"""`fleet models synth KIND --task TASK --name NAME`: build a model of a real architecture with seeded random weights
into the model repository (``fleet.repository.synth``), as a cost stand-in.

    fleet models synth deberta-v2-base --task token-classification --name extract [--repository models] [--seed 0]

writes ``<repository>/extract/1/`` (config, ``model.safetensors``, a WordPiece tokenizer and ``model.yaml`` with the
digests), about 440 MB for deberta-v2-base. Its outputs are meaningless: it stands in for the cost of the seeds'
RexUniNLU service. Every failure is one ``error: ...`` line and exit code 2.

``register_synth(models_app)`` adds the command to the ``fleet models`` sub-app (``fleet.cli.models_cmd``).
"""

# No ``from __future__ import annotations``: typer evaluates the commands' annotations.
from pathlib import Path
from typing import Annotated

import typer

REPOSITORY_ENV = "FLEET_MODEL_REPOSITORY"
DEFAULT_REPOSITORY = Path("models")


def synth(
    kind: Annotated[str, typer.Argument(help="the architecture: deberta-v2-base (or deberta-v2-tiny, for tests)")],
    name: Annotated[str, typer.Option("--name", help="the model's name in the repository, e.g. extract")],
    task: Annotated[str, typer.Option("--task", help="what its head does")] = "token-classification",
    version: Annotated[str, typer.Option("--version", help="the version folder to write (must not exist yet)")] = "1",
    repository: Annotated[
        Path, typer.Option("--repository", envvar=REPOSITORY_ENV, help=f"the repository folder (env {REPOSITORY_ENV})")
    ] = DEFAULT_REPOSITORY,
    seed: Annotated[int, typer.Option("--seed", min=0, help="the seed the weights are drawn from")] = 0,
) -> None:
    """Build a cost stand-in: KIND's architecture with seeded random weights, written as NAME@VERSION.

    Its compute is the real architecture's and its outputs are meaningless: `model.yaml` says so in its
    description and labels. The tokenizer is all-MiniLM-L6-v2's WordPiece (DeBERTa's sentencepiece model is not
    available offline). The entry's L3 cache is keyed by `embed`'s vectors of its `text`.
    """
    from fleet.cli.common import err, fail
    from fleet.errors import ConfigError
    from fleet.models import check_model_name
    from fleet.repository.synth import synthesize
    from fleet.schemas.manifest import VERSION_RE

    try:
        check_model_name(name)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    if not VERSION_RE.match(version):
        raise fail(f"--version {version!r}: use 1-32 lower-case letters, digits or '_', starting with one of the first")
    folder = repository / name / version
    err.print(f"building {kind} ({task}, seed {seed}) into {folder} ...", highlight=False)
    _quiet_transformers()
    try:
        manifest = synthesize(kind, task, folder, seed)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    size_mb = sum((folder / f).stat().st_size for f in manifest.weights.files) / 1e6
    err.print(f"{name}@{version}: {len(manifest.weights.files)} files, {size_mb:.0f} MB; {manifest.labels['stand-in']}")
    print(folder)


def _quiet_transformers() -> None:
    """No progress bars from transformers' save (the command prints its own one line)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def register_synth(app: typer.Typer) -> None:
    """Add ``synth`` to a ``fleet models`` sub-app."""
    app.command("synth")(synth)
