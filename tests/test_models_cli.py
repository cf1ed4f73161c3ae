"""`fleet models`: add, list, show, verify, keygen, sign and pull (a file:// snapshot; the Hub, which cannot be
reached here, fails in one line), each failure one ``error:`` line with no traceback."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner, Result

from fleet import models
from fleet.cli import app as cli_app
from fleet.repository.layout import Repository
from tests.processes import run_fleet
from tests.repository_fixtures import tiny_model


@pytest.fixture(autouse=True)
def _default_repository() -> Iterator[None]:
    before = models.default_repository()
    yield
    models.use_repository(before)


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "classifier")


def fleet(*args: str, **env: str) -> Result:
    return CliRunner().invoke(cli_app, ["models", *args], prog_name="fleet", env=env or None)


def one_error_line(result: Result) -> str:
    """The one ``error:`` line a failed command wrote (and no traceback)."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_add_list_show_and_verify_a_folder(tiny_classifier: Path, tmp_path: Path) -> None:
    repo = str(tmp_path / "models")
    added = fleet("add", str(tiny_classifier), "--name", "sentiment", "--repository", repo, "--task", "sentiment")
    assert added.exit_code == 0, added.output
    assert added.stdout.strip() == "sentiment@1"
    assert "runtime classification (from config.json)" in added.stderr
    assert (
        fleet("add", str(tiny_classifier), "--name", "sentiment", "--repository", repo).stdout.strip() == "sentiment@2"
    )
    pinned = fleet(
        "add", str(tiny_classifier), "--name", "ranker", "--runtime", "rerank", "--version", "7", "--repository", repo
    )
    assert pinned.stdout.strip() == "ranker@7"

    listed = fleet("list", "--repository", repo)
    rows = [line.split() for line in listed.stdout.strip().splitlines()]
    assert rows == [
        ["name", "versions", "runtime", "default"],
        ["ranker", "7", "rerank", "7"],
        ["sentiment", "1,", "2", "classification", "2"],
    ]

    broken = tmp_path / "models" / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / "model.yaml").write_text("runtime: [\n")
    listed = fleet("list", "--repository", repo)
    assert listed.exit_code == 1 and ["broken", "1", "(invalid)", "1"] in [
        r.split() for r in listed.stdout.splitlines()
    ]
    assert "broken/1/model.yaml: line 2, column 1" in one_error_line(listed)
    shutil.rmtree(broken.parent)

    shown = fleet("show", "sentiment@1", "--repository", repo)
    assert shown.exit_code == 0, shown.output
    head, _, rest = shown.stdout.partition("\n")
    assert head.startswith("# sentiment@1  folder ")
    manifest = yaml.safe_load(rest.partition("file ")[0])
    assert manifest["runtime"] == "classification" and manifest["task"] == "sentiment"
    size = (tiny_classifier / "model.safetensors").stat().st_size
    assert any(
        line.split()[:3] == ["model.safetensors", f"{size / 1024:.1f}", "KB"] for line in shown.stdout.splitlines()
    )

    verified = fleet("verify", "--repository", repo)
    assert verified.exit_code == 0, verified.output
    assert verified.stdout.split("\n")[:3] == [
        "ranker@7: ok (5 files)",
        "sentiment@1: ok (5 files)",
        "sentiment@2: ok (5 files)",
    ]
    with (tmp_path / "models" / "sentiment" / "1" / "tokenizer.json").open("a") as f:
        f.write(" ")
    line = one_error_line(fleet("verify", "sentiment", "--repository", repo))
    assert line == "error: model sentiment@1: weight file tokenizer.json does not match its sha256 in model.yaml"
    assert fleet("verify", "sentiment@2", "--repository", repo).exit_code == 0


def test_add_refuses_pickles_unknown_runtimes_and_bad_names_in_one_line(tiny_classifier: Path, tmp_path: Path) -> None:
    repo = str(tmp_path / "models")
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text('{"architectures": ["BertForSequenceClassification"]}')
    (pickles / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    line = one_error_line(fleet("add", str(pickles), "--name", "p", "--repository", repo))
    assert "holds only pickled weights (pytorch_model.bin), which Fleet never loads" in line
    lm = tmp_path / "lm"
    shutil.copytree(tiny_classifier, lm)
    (lm / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    line = one_error_line(fleet("add", str(lm), "--name", "lm", "--repository", repo))
    assert "cannot tell the runtime from architectures (GPT2LMHeadModel); pass --runtime embeddings|" in line
    assert "is not allowed" in one_error_line(fleet("add", str(lm), "--name", "../x", "--repository", repo))
    assert "no such folder" in one_error_line(fleet("add", str(tmp_path / "nope"), "--name", "x", "--repository", repo))
    assert Repository(repo).names() == []
    assert "no models in" in fleet("list", "--repository", repo).stderr
    assert "unknown model 'nope'" in one_error_line(fleet("show", "nope", "--repository", repo))


def test_keygen_sign_and_verify_with_the_public_key(tiny_classifier: Path, tmp_path: Path) -> None:
    repo = str(tmp_path / "models")
    key = tmp_path / "keys" / "fleet-models.pem"
    key.parent.mkdir()
    made = fleet("keygen", str(key))
    assert made.exit_code == 0, made.output
    assert made.stdout.strip() == f"{key}.pub"
    assert os.stat(key).st_mode & 0o777 == 0o600
    assert "exists already" in one_error_line(fleet("keygen", str(key)))

    fleet("add", str(tiny_classifier), "--name", "sentiment", "--repository", repo)
    fleet("add", str(tiny_classifier), "--name", "sentiment", "--repository", repo)
    signed = fleet("sign", "sentiment@1", "--private-key", str(key), "--repository", repo)
    assert signed.exit_code == 0, signed.output
    assert Path(signed.stdout.strip()) == tmp_path / "models" / "sentiment" / "1" / "model.yaml.sig"

    with_key = {"FLEET_MODEL_PUBLIC_KEY": f"{key}.pub"}
    assert fleet("verify", "sentiment@1", "--repository", repo, **with_key).exit_code == 0
    line = one_error_line(fleet("verify", "sentiment@2", "--repository", repo, **with_key))
    assert (
        "sentiment/2/model.yaml: no model.yaml.sig, and FLEET_MODEL_PUBLIC_KEY requires every model to be signed"
        in line
    )
    manifest = tmp_path / "models" / "sentiment" / "1" / "model.yaml"
    manifest.write_text(manifest.read_text().replace("runtime: classification", "runtime: rerank"))
    line = one_error_line(fleet("verify", "sentiment@1", "--repository", repo, **with_key))
    assert "model.yaml.sig: not a valid signature of model.yaml" in line
    assert "not an unencrypted PEM private key" in one_error_line(
        fleet("sign", "sentiment@2", "--private-key", f"{key}.pub", "--repository", repo)
    )


def test_pull_from_a_file_snapshot_records_its_digests_and_source(tiny_classifier: Path, tmp_path: Path) -> None:
    repo = str(tmp_path / "models")
    snapshot = tmp_path / "snapshot"
    shutil.copytree(tiny_classifier, snapshot)
    (snapshot / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")  # beside safetensors: left out
    (snapshot / ".cache").mkdir()
    (snapshot / ".cache" / "x.lock").write_text("")
    pulled = fleet("pull", snapshot.as_uri(), "--name", "snap", "--repository", repo)
    assert pulled.exit_code == 0, pulled.output
    assert pulled.stdout.strip() == "snap@1"
    entry = Repository(repo).get("snap")
    assert set(entry.manifest.weights.files) == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
    }
    assert entry.manifest.labels == {"source": f"file://{snapshot}"}
    assert fleet("verify", "snap", "--repository", repo).exit_code == 0
    assert "no such folder" in one_error_line(fleet("pull", (tmp_path / "nope").as_uri(), "--repository", repo))


@pytest.mark.services  # a `fleet` process
@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_pull_from_an_unreachable_hub_fails_in_one_line(tmp_path: Path, env: dict[str, str]) -> None:
    repo = tmp_path / "models"
    done = run_fleet(
        "models", "pull", "sentence-transformers/all-MiniLM-L6-v2@main", "--repository", str(repo), env=env
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        "error: cannot reach the Hugging Face Hub to pull sentence-transformers/all-MiniLM-L6-v2 (no network, or "
        "HF_HUB_OFFLINE is set); download the snapshot elsewhere and use: fleet models pull file:///path/to/folder "
        "--name NAME"
    )
    assert list(repo.iterdir()) == []  # the download's folder is gone
    bad = run_fleet("models", "pull", "../../etc", "--repository", str(repo))
    assert bad.returncode == 1
    assert (
        bad.stderr.strip() == "error: '../../etc' is not a Hub model id: write ORG/NAME[@revision], or file:///folder"
    )


def test_each_command_explains_itself() -> None:
    for command in ("add", "list", "show", "verify", "sign", "keygen", "pull"):
        shown = fleet(command, "--help")
        assert shown.exit_code == 0, shown.output
        assert "Usage: fleet models " + command in shown.stdout
    assert "--repository" in fleet("add", "--help").stdout
